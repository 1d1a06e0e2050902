"""docs/examples: the FastAPI and Django apps, driven over HTTP on a real
database: a successful request leaves its order and exactly one job; a
failing one leaves neither; a worker then ships the order."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.test import Client as DjangoClient
from fastapi.testclient import TestClient

import pgq
from docs.examples import django_app, fastapi_app
from pgq.testing import run_jobs

ORDER = {"reference": "A-1", "sku": "book", "quantity": 2}


def all_jobs(client: pgq.Client) -> list[tuple[str, Any]]:
    """Every job of the database, whatever its queue or state: (queue, decoded body)."""
    cursor, jobs = client.jscan(count=1000, reply="all")
    assert cursor == 0
    return [(job["queue"], json.loads(job["body"])) for job in jobs]


def orders(db: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    return db.execute(f"SELECT id, reference, sku, quantity, status FROM {table} ORDER BY id").fetchall()


# ------------------------------------------------------------------ FastAPI


@pytest.fixture
def fastapi_http(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The FastAPI app, started (lifespan) on this test's database, over HTTP."""
    monkeypatch.setenv("PGQ_DSN", dsn)
    with TestClient(fastapi_app.app) as http:  # stops the app's pool and client on exit
        yield http


def test_fastapi_an_order_and_its_job_commit_together(fastapi_http: TestClient, client: pgq.Client,
                                                      db: psycopg.Connection[Any]) -> None:
    reply = fastapi_http.post("/orders", json=ORDER)
    assert reply.status_code == 201, reply.text
    order_id, job_id = reply.json()["id"], reply.json()["job"]
    assert orders(db, "orders") == [(order_id, "A-1", "book", 2, "new")]
    assert all_jobs(client) == [("shipping", {"order_id": order_id, "sku": "book", "quantity": 2})]
    assert client.show(job_id)["state"] == "queued"

    # the worker's side: the update commits with the ACK
    worker = pgq.Worker(client, queues=[fastapi_app.QUEUE], handler=fastapi_app.ship_order,
                        transactional=True)
    stats = run_jobs(worker)
    assert (stats.succeeded, stats.failed) == (1, 0)
    assert orders(db, "orders")[0][-1] == "shipped"
    assert client.qlen("shipping") == 0 and all_jobs(client) == []
    # A job naming no order of this app fails (retried, then dead-lettered):
    # it was acknowledged, shipping nothing (or another app's order number).
    stray = client.add_job(fastapi_app.QUEUE, json.dumps({"order_id": order_id + 1000}), retry=60)
    stats = run_jobs(pgq.Worker(client, queues=[fastapi_app.QUEUE], handler=fastapi_app.ship_order,
                                transactional=True))
    assert (stats.succeeded, stats.failed) == (0, 1) and client.show(stray)["nacks"] == 1


def test_fastapi_a_failing_request_leaves_neither_order_nor_job(fastapi_http: TestClient, client: pgq.Client,
                                                                db: psycopg.Connection[Any]) -> None:
    reply = fastapi_http.post("/orders", json={**ORDER, "fail": True})  # raises after the enqueue
    assert reply.status_code == 500
    assert orders(db, "orders") == [] and all_jobs(client) == []

    assert fastapi_http.post("/orders", json=ORDER).status_code == 201  # the pool's connection is fine
    duplicate = fastapi_http.post("/orders", json={**ORDER, "quantity": 5})  # UNIQUE (reference)
    assert duplicate.status_code == 409, duplicate.text
    assert [row[1:4] for row in orders(db, "orders")] == [("A-1", "book", 2)]
    assert [queue for queue, _ in all_jobs(client)] == ["shipping"]
    assert client.qlen("shipping") == 1


# ------------------------------------------------------------------ Django


@pytest.fixture
def django_http(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[DjangoClient]:
    """The Django project on this test's database, with Django's test client.

    Django's settings are configured once per process (in code: no
    DJANGO_SETTINGS_MODULE); later tests point its default database at
    their own. Django's connections and the example's pgq client are closed
    after each test."""
    from django.apps import apps
    from django.conf import settings
    from django.db import connections

    monkeypatch.setenv("PGQ_DSN", dsn)
    django_app.client.cache_clear()
    if not settings.configured:
        django_app.configure()
    elif not apps.is_installed(django_app.__name__):
        pytest.skip("Django is configured for another project in this process")
    else:
        connections.close_all()
        connections["default"].settings_dict.update(django_app.database(dsn))
    from docs.examples.django_app import orders as app_orders

    try:
        app_orders.create_tables()
        yield DjangoClient(raise_request_exception=False)
    finally:
        connections.close_all()
        django_app.client().close()
        django_app.client.cache_clear()


def post(http: DjangoClient, data: dict[str, Any]) -> Any:
    return http.post("/orders", data=json.dumps(data), content_type="application/json")


def test_django_an_order_and_its_job_commit_together(django_http: DjangoClient, client: pgq.Client,
                                                     db: psycopg.Connection[Any]) -> None:
    from docs.examples.django_app import orders as app_orders

    reply = post(django_http, ORDER)
    assert reply.status_code == 201, reply.content
    order_id, job_id = reply.json()["id"], reply.json()["job"]
    assert orders(db, "django_app_order") == [(order_id, "A-1", "book", 2, "new")]
    assert all_jobs(client) == [("django-shipping", {"order_id": order_id, "sku": "book", "quantity": 2})]
    assert client.show(job_id)["state"] == "queued"

    stats = run_jobs(pgq.Worker(client, queues=[app_orders.QUEUE], handler=app_orders.ship_order))
    assert (stats.succeeded, stats.failed) == (1, 0)
    assert app_orders.Order.objects.get(pk=order_id).status == "shipped"
    assert client.qlen("django-shipping") == 0 and all_jobs(client) == []
    stray = client.add_job(app_orders.QUEUE, json.dumps({"order_id": order_id + 1000}), retry=60)
    stats = run_jobs(pgq.Worker(client, queues=[app_orders.QUEUE], handler=app_orders.ship_order))
    assert (stats.succeeded, stats.failed) == (0, 1) and client.show(stray)["nacks"] == 1


def test_django_a_failing_request_leaves_neither_order_nor_job(django_http: DjangoClient, client: pgq.Client,
                                                               db: psycopg.Connection[Any]) -> None:
    reply = post(django_http, {**ORDER, "fail": True})  # raises after the enqueue
    assert reply.status_code == 500
    assert orders(db, "django_app_order") == [] and all_jobs(client) == []

    assert post(django_http, ORDER).status_code == 201  # Django's connection is fine
    duplicate = post(django_http, {**ORDER, "quantity": 5})  # UNIQUE (reference)
    assert duplicate.status_code == 409, duplicate.content
    assert [row[1:4] for row in orders(db, "django_app_order")] == [("A-1", "book", 2)]
    assert [queue for queue, _ in all_jobs(client)] == ["django-shipping"]
    assert client.qlen("django-shipping") == 1
