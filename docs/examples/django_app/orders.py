"""The Django example's orders: the model, ``POST /orders`` and the worker's handler.

Import it after :func:`docs.examples.django_app.configure` (Django defines
models only once its settings are configured); it is the project's URLconf.
"""

from __future__ import annotations

import json

from django.db import IntegrityError, connection, models, transaction
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.http import require_POST

import pgq

from . import client

QUEUE = "django-shipping"  # its own: the FastAPI example's orders have IDs from 1 too


class Order(models.Model):
    reference = models.CharField(max_length=64, unique=True)  # the client's idempotency key
    sku = models.CharField(max_length=64)
    quantity = models.PositiveIntegerField()
    status = models.CharField(max_length=16, default="new")


def create_tables() -> None:
    """Create the orders table if it is missing (this example has no migrations)."""
    if Order._meta.db_table not in connection.introspection.table_names():
        with connection.schema_editor() as editor:
            editor.create_model(Order)


@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    """Create the order and enqueue its shipping job in one transaction."""
    data = json.loads(request.body)
    try:
        with transaction.atomic():
            order = Order.objects.create(reference=data["reference"], sku=data["sku"],
                                         quantity=data["quantity"])
            body = json.dumps({"order_id": order.pk, "sku": order.sku, "quantity": order.quantity})
            # Django's own psycopg connection, in the atomic block's transaction:
            job_id = client().add_job(QUEUE, body, retry=60, conn=connection.connection)
            if data.get("fail"):
                raise RuntimeError("failed after the enqueue: the order and its job are rolled back")
    except IntegrityError:
        return JsonResponse({"error": f"order {data['reference']!r} exists already"}, status=409)
    return JsonResponse({"id": order.pk, "job": job_id}, status=201)


urlpatterns = [path("orders", create_order)]


def ship_order(job: pgq.Job) -> None:
    """The worker's handler: marks the order shipped (idempotent, as an
    at-least-once job's handler should be: a job may run twice)."""
    order_id = json.loads(job.body)["order_id"]
    try:
        if Order.objects.filter(pk=order_id).update(status="shipped") != 1:
            raise LookupError(f"no order {order_id} to ship")  # retried, then dead-lettered
    finally:
        connection.close()  # the worker runs handlers in threads: leave no connection behind
