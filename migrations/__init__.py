"""Alembic migrations of schema ``pgq`` (installed as ``pgq.migrations``).

Run them with ``pgq migrate`` or :func:`pgq.migrate`; the embedded server's
database is migrated automatically by the client.
"""
