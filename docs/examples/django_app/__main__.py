"""The Django example's ``manage.py``: ``python -m docs.examples.django_app COMMAND``.

``worker`` runs a pgq worker on the ``django-shipping`` queue (until SIGTERM or
Ctrl-C); any other command is Django's (``runserver``, ``shell``, ...), run
after the orders table is created if it is missing.
"""

from __future__ import annotations

import sys

import pgq

from . import client, configure


def main(argv: list[str]) -> None:
    configure()
    from .orders import QUEUE, create_tables, ship_order

    create_tables()
    if argv[1:] == ["worker"]:
        pgq.Worker(client(), queues=[QUEUE], handler=ship_order).run()
        return
    from django.core.management import execute_from_command_line

    execute_from_command_line(argv)


if __name__ == "__main__":
    main(sys.argv)
