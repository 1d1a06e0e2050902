"""pgq schema, version 10: a job's ctime reads pgq's clock.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25

Schema 0008 gave every statement one clock, ``pgq.now()``, but the default
of ``pgq.jobs.ctime`` still read ``clock_timestamp()``. Under the simulation
(which sets ``pgq.now()`` to virtual time) a job was then created in real
time and judged in virtual time: WORKING found half its TTL long gone. The
default now reads ``pgq.now()``; the per-millisecond sequence still orders
the jobs of one statement (they share its timestamp).
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_DEFAULT = ("(((floor((date_part('epoch'::text, {clock}) * (1000)::double precision)))"
            "::bigint * 1000000) + (nextval('pgq.ctime_seq'::regclass) % (1000000)::bigint))")


def upgrade() -> None:
    op.execute(f"ALTER TABLE pgq.jobs ALTER COLUMN ctime SET DEFAULT {_DEFAULT.format(clock='pgq.now()')}")


def downgrade() -> None:
    op.execute("ALTER TABLE pgq.jobs ALTER COLUMN ctime SET DEFAULT "
               + _DEFAULT.format(clock="clock_timestamp()"))
