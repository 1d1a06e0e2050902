"""Django: an order and its shipping job, committed together or not at all.

A minimal project configured in code (no settings module, no
``DJANGO_SETTINGS_MODULE``): this package is both the project and its only
app. ``orders.py`` holds the ``Order`` model, the view and the worker's
handler; ``__main__.py`` is its ``manage.py``.

``POST /orders`` creates an ``Order`` and adds a job to the ``django-shipping``
queue inside one ``transaction.atomic()`` block. pgq runs its statements on
the connection Django uses (``django.db.connection.connection``, a psycopg 3
connection with Django 4.2+), so the job commits with the order, or rolls
back with it when anything in the block raises (``"fail": true`` in the
body) or the insert breaks a constraint (a second order with the same
``reference``: 409).

Run it from the repository's root::

    export PGQ_DSN=postgresql://app@localhost/shop   # unset: pgq's embedded server
    pgq migrate                                      # schema pgq in that database
    python -m docs.examples.django_app runserver     # creates the orders table first
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"reference": "A-1", "sku": "book", "quantity": 2}'

and consume the jobs in another shell::

    python -m docs.examples.django_app worker        # ships orders until Ctrl-C
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import pgq


@cache
def client() -> pgq.Client:
    """The process's pgq client: ``$PGQ_DSN``, or the embedded server when unset."""
    return pgq.Client(os.environ.get("PGQ_DSN"))


def database(dsn: str) -> dict[str, Any]:
    """Django's ``DATABASES["default"]`` for a libpq DSN (URL or key=value)."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(dsn)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.pop("dbname", ""),
        "USER": params.pop("user", ""),
        "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""),
        "PORT": params.pop("port", ""),
        "OPTIONS": params,  # sslmode, application_name, ...: passed to psycopg as they are
    }


def configure() -> None:
    """Configure Django for this project on pgq's database, once per process
    (later calls do nothing)."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        DEBUG=False,
        SECRET_KEY="an example, not a secret",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=f"{__name__}.orders",
        INSTALLED_APPS=[__name__],
        DATABASES={"default": database(client().dsn)},
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        USE_TZ=True,
    )
    django.setup()
