"""The cluster layer of pgq (installed as ``pgq.cluster``).

The node process (``node.py``, wiring) around an I/O-free core
(``core.py``) whose decisions live in pure modules: membership (SWIM +
Lifeguard), replication to W node databases, re-queue coordination, ACK
collection, federation; the authenticated bus (``bus.py``, ``wire.py``)
behind a transport seam, and the seeded simulation that runs the same core
under a virtual clock (``simulation.py``, ``scenario.py``). The protocols
as state machines, and which module holds each: ``docs/cluster-protocol.md``.
"""
