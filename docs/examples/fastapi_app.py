"""FastAPI: an order and its shipping job, committed together or not at all.

``POST /orders`` inserts a row into ``orders`` and adds a job to the
``shipping`` queue on the same psycopg connection, in the same transaction:

* the request succeeds: both commit, and a worker ships the order;
* the request fails after the enqueue (``"fail": true`` in the body, or any
  exception), or the insert breaks a constraint (a second order with the same
  ``reference``: 409): both roll back, so there is neither an order nor a job.

There is no window where a job names an order that does not exist, nor an
order that no worker will ever ship. The worker's side is transactional too:
``ship_order`` marks the order shipped, and that update commits with the
job's ACK.

Run it from the repository's root::

    export PGQ_DSN=postgresql://app@localhost/shop   # unset: pgq's embedded server
    pgq migrate                                      # schema pgq in that database
    uvicorn docs.examples.fastapi_app:app
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"reference": "A-1", "sku": "book", "quantity": 2}'

and consume the jobs in another shell::

    pgq worker docs.examples.fastapi_app:ship_order --queue shipping --transactional

(``pgq.AsyncClient`` takes a ``psycopg.AsyncConnection`` as ``conn=`` the
same way, for ``async def`` endpoints.)
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from fastapi import FastAPI, HTTPException, Request
from psycopg_pool import ConnectionPool
from pydantic import BaseModel, Field

import pgq

QUEUE = "shipping"

ORDERS_TABLE = """
CREATE TABLE IF NOT EXISTS orders (
    id        bigserial PRIMARY KEY,
    reference text NOT NULL UNIQUE,
    sku       text NOT NULL,
    quantity  integer NOT NULL CHECK (quantity > 0),
    status    text NOT NULL DEFAULT 'new'
)"""


@dataclass
class Resources:
    """What the app opens at startup: a pgq client and a pool for its own writes."""

    client: pgq.Client
    pool: ConnectionPool


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    client = pgq.Client(os.environ.get("PGQ_DSN"))  # $PGQ_DSN; unset: the embedded server
    pool = ConnectionPool(client.dsn, min_size=1, max_size=8, open=True)
    with pool.connection() as conn:
        conn.execute(ORDERS_TABLE)
    app.state.resources = Resources(client, pool)
    try:
        yield
    finally:
        pool.close()
        client.close()


app = FastAPI(title="pgq: transactional enqueue with FastAPI", lifespan=lifespan)


class NewOrder(BaseModel):
    reference: str = Field(min_length=1)  # the client's idempotency key: UNIQUE
    sku: str = Field(min_length=1)
    quantity: int = Field(gt=0)
    fail: bool = False  # for the demonstration: fail after the enqueue


@app.post("/orders", status_code=201)
def create_order(order: NewOrder, request: Request) -> dict[str, Any]:
    """Insert the order and enqueue its shipping job in one transaction."""
    resources: Resources = request.app.state.resources
    try:
        # One transaction: commits at the end of the block, rolls back if it raises.
        with resources.pool.connection() as conn:
            row = conn.execute(
                "INSERT INTO orders (reference, sku, quantity) VALUES (%s, %s, %s) RETURNING id",
                (order.reference, order.sku, order.quantity)).fetchone()
            assert row is not None
            order_id: int = row[0]
            body = json.dumps({"order_id": order_id, "sku": order.sku, "quantity": order.quantity})
            job_id = resources.client.add_job(QUEUE, body, retry=60, conn=conn)  # in this transaction
            if order.fail:
                raise HTTPException(500, "failed after the enqueue: the order and its job are rolled back")
    except psycopg.errors.UniqueViolation:
        raise HTTPException(409, f"order {order.reference!r} exists already") from None
    return {"id": order_id, "job": job_id}


def ship_order(job: pgq.Job, conn: psycopg.Connection[Any]) -> None:
    """The worker's handler (run with ``--transactional``): marks the order
    shipped; this update and the job's ACK commit together."""
    order_id = json.loads(job.body)["order_id"]
    shipped = conn.execute("UPDATE orders SET status = 'shipped' WHERE id = %s", (order_id,))
    if shipped.rowcount != 1:  # not this app's order: fail (retried, then dead-lettered), never ack
        raise LookupError(f"no order {order_id} to ship")
