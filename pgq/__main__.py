"""``python -m pgq``: the ``pgq`` command, whatever else installed a script
named ``pgq`` (pgqueuer does)."""

from pgq.cli import main

if __name__ == "__main__":
    main()
