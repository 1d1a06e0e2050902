"""``python -m pgq.cli``: the same as the ``pgq`` command."""

from . import main

main()
