"""Network partitions between local nodes, with nftables (root only).

Every node listens on, and connects from, its own 127.0.0.x address (the
bus binds its outgoing connections to the node's address), so a partition
is a set of rules dropping the packets between two groups of addresses in
both directions. Clients connect from 127.0.0.1 and still reach every node.
Established connections are not reset: packets simply stop, as when a cable
is cut. Each run uses a table of its own, removed by :meth:`close`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable

__all__ = ["Netfilter", "unavailable"]


def unavailable() -> str | None:
    """Why partitions cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "nftables rules need root"
    if shutil.which("nft") is None:
        return "nft is not installed (Debian: apt-get install nftables)"
    probe = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"nft cannot list tables: {probe.stderr.strip()}"
    return None


class Netfilter:
    def __init__(self, table: str | None = None) -> None:
        self.table = table or f"pgq_chaos_{os.getpid()}"
        self._nft(f"add table inet {self.table}")
        self._nft(f"add chain inet {self.table} out "
                  "{ type filter hook output priority 0 ; policy accept ; }")

    def isolate(self, inside: Iterable[str], outside: Iterable[str]) -> None:
        """Drop every packet between an address of ``inside`` and one of ``outside``."""
        outside = list(outside)
        for a in inside:
            for b in outside:
                for source, target in ((a, b), (b, a)):
                    self._nft(f"add rule inet {self.table} out ip saddr {source} "
                              f"ip daddr {target} drop")

    def heal(self) -> None:
        self._nft(f"flush chain inet {self.table} out")

    def close(self) -> None:
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)

    @staticmethod
    def _nft(command: str) -> None:
        subprocess.run(["nft", *command.split(" ")], check=True, capture_output=True, text=True)
