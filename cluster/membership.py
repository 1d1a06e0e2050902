"""Cluster membership and failure detection: SWIM with Lifeguard's refinements.

A pure state machine: it is fed time (:meth:`Membership.tick`) and received
messages (:meth:`Membership.receive`) and returns :class:`Send` actions and
:class:`Changed` events; it does no I/O. The node process drives it with
anyio; the tests drive it with a fake clock and a fake network.

The protocol (see docs/cluster-protocol.md for the state diagram):

* Every probe period a node PINGs the next member of a shuffled round-robin.
  Without an ACK within the probe timeout it asks ``indirect_probes`` other
  members to PING the target for it (PINGREQ); without any ACK by the end
  of the period the target becomes *suspect*.
* A suspect that does not refute within its suspicion timeout becomes
  *dead*. A node refutes a suspicion about itself by raising its
  incarnation number, which overrides the suspicion everywhere.
* Updates spread by piggybacking on every message, each sent a bounded
  number of times; a periodic full-state exchange (PUSHPULL) with a random
  member, and with dead members' addresses (the re-join loop), makes healed
  partitions merge again.
* Lifeguard: a local health multiplier (LHM) grows when this node misses
  ACKs or is itself suspected, and stretches its own probe timeouts, so a
  node starved of CPU blames itself rather than its peers; a suspicion's
  timeout starts long and shrinks as independent nodes confirm it.

Failure detection is advisory: it chooses replication targets and ACK
recipients. Safety never depends on it (a false suspicion may cost a
duplicate delivery, never a lost job).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

from .messages import MAX_INCARNATION, MAX_MEMBERS, Ack, Forget, Member, Message, Ping, PingReq, PushPull, is_node_id

__all__ = ["Config", "Membership", "Send", "Changed", "Action"]

STALE_REFUTE_EVERY = 10.0  # seconds between refutations of stale alive records of this node


@dataclass(frozen=True)
class Config:
    """Timing of the protocol (seconds). Defaults detect a killed node in ~10 s
    on 3-10 nodes, and tolerate a node whose event loop stalls for seconds."""

    probe_interval: float = 1.0
    probe_timeout: float = 0.5
    indirect_probes: int = 3
    suspicion_min: float = 5.0
    suspicion_max: float = 15.0
    suspicion_confirmations: int = 3
    max_health: int = 8
    retransmit_mult: int = 4
    push_pull_interval: float = 10.0
    rejoin_interval: float = 5.0
    forget_ban: float = 60.0
    max_piggyback: int = 8


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to the node at ``host:port``."""

    host: str
    port: int
    message: Message


@dataclass(frozen=True, slots=True)
class Changed:
    """A member's record changed (status, incarnation, address or leaving flag)."""

    member: Member
    previous: Member | None


Action = Send | Changed


@dataclass
class _Probe:
    target: str
    seq: int
    started: float
    indirect_sent: bool = False
    acked: bool = False


@dataclass
class _Relay:
    """An indirect probe we run for ``requester``."""

    requester: str
    requester_seq: int
    target: str
    expires: float


@dataclass
class _Suspicion:
    started: float
    confirmations: set[str] = field(default_factory=set)


class Membership:
    """SWIM + Lifeguard membership of one node."""

    def __init__(self, me: Member, config: Config | None = None,
                 rng: random.Random | None = None) -> None:
        self.config = config or Config()
        self.rng = rng or random.Random()
        self.me = me
        self.members: dict[str, Member] = {}
        self.health = 0  # Lifeguard's local health multiplier
        self._seq = 0
        self._order: list[str] = []
        self._probe: _Probe | None = None
        self._next_probe = 0.0
        self._relays: dict[int, _Relay] = {}
        self._suspicions: dict[str, _Suspicion] = {}
        self._gossip: dict[str, list] = {}  # node id -> [member record, transmissions]
        self._banned: dict[str, float] = {}
        self._next_push_pull = 0.0
        self._next_rejoin = 0.0
        self._seeds: list[tuple[str, int]] = []
        self._stale_refuted_at = float("-inf")  # see _about_me

    # ------------------------------------------------------------ queries

    def view(self) -> list[Member]:
        """Every known member, this node first."""
        return [self.me, *sorted(self.members.values(), key=lambda m: m.id)]

    def reachable(self) -> list[Member]:
        """Peers believed alive and not leaving: candidates for copies and ACKs."""
        return [m for m in self.members.values() if m.status == "alive" and not m.leaving]

    def live_peers(self) -> list[Member]:
        """Peers not declared dead (alive or suspect)."""
        return [m for m in self.members.values() if m.status in ("alive", "suspect")]

    def get(self, node_id: str) -> Member | None:
        return self.me if node_id == self.me.id else self.members.get(node_id)

    def _scaled(self, seconds: float) -> float:
        return seconds * (self.health + 1)

    # ------------------------------------------------------------ commands

    def join(self, host: str, port: int, now: float) -> list[Action]:
        """Contact a node by address (``--join``, CLUSTER MEET); keep it as a seed."""
        if (host, port) not in self._seeds:
            self._seeds.append((host, port))
        return [Send(host, port, PushPull(tuple(self.view()), reply=True))]

    def set_leaving(self, leaving: bool, now: float) -> list[Action]:
        if self.me.leaving == leaving:
            return []
        self.me = replace(self.me, leaving=leaving, incarnation=self.me.incarnation + 1)
        self._enqueue_gossip(self.me)
        return [Changed(self.me, None)]

    def forget(self, node_id: str, now: float, broadcast: bool = True) -> list[Action]:
        """Drop a node and refuse news of it for ``forget_ban`` seconds.
        Never this node: it would ban itself and have every peer drop it (the
        CLI refuses that; a hand-written event or a peer's FORGET is ignored)."""
        actions: list[Action] = []
        # Nor an ID that is no node's (a hand-written FORGET event): it was
        # banned and sent to every peer, whose decoders refused the message
        # and closed the link, losing what else it carried.
        if node_id == self.me.id or not is_node_id(node_id):
            return actions
        if broadcast:
            actions += [Send(m.host, m.port, Forget(node_id)) for m in self.live_peers()
                        if m.id != node_id]
        self._banned[node_id] = now + self.config.forget_ban
        gone = self.members.pop(node_id, None)
        self._suspicions.pop(node_id, None)
        self._gossip.pop(node_id, None)
        if gone is not None:
            actions.append(Changed(replace(gone, status="left"), gone))
        return actions

    # ------------------------------------------------------------ time

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        actions += self._advance_probe(now)
        actions += self._expire_suspicions(now)
        for seq in [s for s, r in self._relays.items() if r.expires <= now]:
            del self._relays[seq]
        for node in [n for n, until in self._banned.items() if until <= now]:
            del self._banned[node]
        if now >= self._next_push_pull:
            self._next_push_pull = now + self.config.push_pull_interval
            peers = self.live_peers()
            if peers:
                target = self.rng.choice(peers)
                actions.append(Send(target.host, target.port, PushPull(tuple(self.view()), True)))
        if now >= self._next_rejoin:
            self._next_rejoin = now + self.config.rejoin_interval
            actions += self._rejoin()
        return actions

    def _rejoin(self) -> list[Action]:
        # Heal partitions: talk to one dead member, and to seeds when alone.
        actions: list[Action] = []
        dead = [m for m in self.members.values() if m.status == "dead"]
        if dead:
            target = self.rng.choice(dead)
            actions.append(Send(target.host, target.port, PushPull(tuple(self.view()), True)))
        if not self.live_peers():
            for host, port in self._seeds:
                actions.append(Send(host, port, PushPull(tuple(self.view()), True)))
        return actions

    def _advance_probe(self, now: float) -> list[Action]:
        actions: list[Action] = []
        probe = self._probe
        if probe is not None and not probe.acked:
            if not probe.indirect_sent and now >= probe.started + self._scaled(self.config.probe_timeout):
                probe.indirect_sent = True
                actions += self._indirect(probe)
            if now >= probe.started + self._scaled(self.config.probe_interval):
                self._probe = None
                self.health = min(self.health + 1, self.config.max_health)
                actions += self._suspect(probe.target, self.me.id, now)
        if self._probe is None or self._probe.acked:
            if now >= self._next_probe:
                actions += self._start_probe(now)
        return actions

    def _start_probe(self, now: float) -> list[Action]:
        candidates = {m.id for m in self.live_peers()}
        self._order = [n for n in self._order if n in candidates]
        if not self._order:
            self._order = sorted(candidates)
            self.rng.shuffle(self._order)
        if not self._order:
            self._probe = None
            self._next_probe = now + self.config.probe_interval
            return []
        target = self.members[self._order.pop(0)]
        self._seq += 1
        self._probe = _Probe(target.id, self._seq, now)
        self._next_probe = now + self._scaled(self.config.probe_interval)
        return [Send(target.host, target.port, Ping(self._seq, self._piggyback(target)))]

    def _indirect(self, probe: _Probe) -> list[Action]:
        helpers = [m for m in self.reachable() if m.id != probe.target]
        self.rng.shuffle(helpers)
        return [Send(h.host, h.port, PingReq(probe.seq, probe.target, self._piggyback()))
                for h in helpers[:self.config.indirect_probes]]

    # ------------------------------------------------------------ suspicion

    def _suspicion_timeout(self, suspicion: _Suspicion) -> float:
        # Lifeguard: start at suspicion_max, shrink towards suspicion_min as
        # independent nodes confirm; in a small cluster fewer confirmations
        # are possible, so fewer are expected.
        c = self.config
        # Confirmations can only come from members still alive (we are one).
        witnesses = 1 + sum(1 for m in self.members.values() if m.status == "alive")
        k = max(min(c.suspicion_confirmations, witnesses - 1), 1)
        confirmed = min(len(suspicion.confirmations) - 1, k)
        fraction = math.log(confirmed + 1) / math.log(k + 1) if confirmed > 0 else 0.0
        return max(c.suspicion_min, c.suspicion_max - (c.suspicion_max - c.suspicion_min) * fraction)

    def _suspect(self, node_id: str, by: str, now: float) -> list[Action]:
        member = self.members.get(node_id)
        if member is None or member.status in ("dead", "left"):
            return []
        if member.status == "suspect":
            self._suspicions.setdefault(node_id, _Suspicion(now, {by})).confirmations.add(by)
            return []
        suspected = replace(member, status="suspect")
        self.members[node_id] = suspected
        self._suspicions[node_id] = _Suspicion(now, {by})
        self._enqueue_gossip(suspected)
        return [Changed(suspected, member)]

    def _expire_suspicions(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for node_id, suspicion in list(self._suspicions.items()):
            member = self.members.get(node_id)
            if member is None or member.status != "suspect":
                del self._suspicions[node_id]
                continue
            if now >= suspicion.started + self._suspicion_timeout(suspicion):
                del self._suspicions[node_id]
                dead = replace(member, status="dead")
                self.members[node_id] = dead
                self._enqueue_gossip(dead)
                actions.append(Changed(dead, member))
        return actions

    # ------------------------------------------------------------ receiving

    def ignores(self, sender: str) -> bool:
        """Whether messages from ``sender`` are ignored (forgotten lately)."""
        return sender in self._banned

    def receive(self, sender: str, message: Message, now: float) -> list[Action]:
        """Handle a membership message from node ``sender`` (authenticated by the bus)."""
        if self.ignores(sender):
            return []
        actions: list[Action] = []
        updates = getattr(message, "updates", ())
        if isinstance(message, PushPull):
            updates = message.members
        for update in updates:
            actions += self._apply(update, sender, now)
        if isinstance(message, Ping):
            actions += self._reply(sender, Ack(message.seq, self.me.id, self._piggyback()))
        elif isinstance(message, Ack):
            actions += self._on_ack(sender, message, now)
        elif isinstance(message, PingReq):
            target = self.members.get(message.target)
            if target is not None:
                self._seq += 1
                self._relays[self._seq] = _Relay(sender, message.seq, message.target,
                                                 now + self._scaled(self.config.probe_interval) * 2)
                actions.append(Send(target.host, target.port,
                                    Ping(self._seq, self._piggyback(target))))
        elif isinstance(message, PushPull) and message.reply:
            # Answered at the address the sender gives for itself: a node
            # restarted on a new address, whose record here did not change
            # (its incarnation no higher than the one we hold), was answered
            # at its old address for ever, and never heard from anyone.
            own = next((u for u in message.members if u.id == sender), None)
            answer = PushPull(tuple(self.view()), reply=False)
            actions += [Send(own.host, own.port, answer)] if own is not None \
                else self._reply(sender, answer)
        elif isinstance(message, Forget):
            if message.node == self.me.id:
                return actions  # nobody forgets us on our behalf
            actions += self.forget(message.node, now, broadcast=False)
        return actions

    def _reply(self, sender: str, message: Message) -> list[Action]:
        member = self.members.get(sender)
        if member is None:
            return []
        return [Send(member.host, member.port, message)]

    def _on_ack(self, sender: str, ack: Ack, now: float) -> list[Action]:
        probe = self._probe
        if probe is not None and ack.seq == probe.seq and ack.target == probe.target:
            probe.acked = True
            self.health = max(self.health - 1, 0)
            return []
        relay = self._relays.pop(ack.seq, None)
        if relay is not None and relay.target == ack.target:
            requester = self.members.get(relay.requester)
            if requester is not None:
                return [Send(requester.host, requester.port,
                             Ack(relay.requester_seq, relay.target, self._piggyback()))]
        return []

    def _apply(self, update: Member, sender: str, now: float) -> list[Action]:
        """Merge one gossiped record with SWIM's precedence rules."""
        if update.id in self._banned:
            return []
        if update.id == self.me.id:
            return self._about_me(update, now)
        current = self.members.get(update.id)
        if current is None:
            if update.status in ("dead", "left"):
                return []  # never learn a node from news of its death
            if len(self.members) + 1 >= MAX_MEMBERS:
                # A full view must still fit one PUSHPULL, which peers refuse
                # past MAX_MEMBERS: a table grown by fake records made every
                # later PUSHPULL of this node undeliverable.
                return []
            return self._store(update, None)
        if update.status == "alive":
            # Only a higher incarnation (issued by the node itself) outranks
            # what we know: that is how suspicions are refuted.
            if update.incarnation > current.incarnation:
                self._suspicions.pop(update.id, None)
                return self._store(update, current)
            return []
        if update.status == "suspect":
            if current.status == "alive" and update.incarnation >= current.incarnation or \
                    current.status == "suspect" and update.incarnation > current.incarnation:
                actions = self._store(replace(update, host=current.host, port=current.port), current)
                self._suspicions[update.id] = _Suspicion(now, {sender})
                return actions
            if current.status == "suspect" and update.incarnation == current.incarnation:
                self._suspicions.setdefault(update.id, _Suspicion(now)).confirmations.add(sender)
            return []
        # dead or left
        if current.status not in ("dead", "left") and update.incarnation >= current.incarnation:
            self._suspicions.pop(update.id, None)
            return self._store(replace(update, host=current.host, port=current.port), current)
        if current.status == "dead" and update.status == "left":
            return self._store(update, current)
        return []

    def _about_me(self, update: Member, now: float) -> list[Action]:
        # Refute any claim that we are suspect or dead by outranking it.
        # A claim at the wire's bound cannot be outranked: refuting it would
        # make an incarnation every peer's decoder refuses, and this node's
        # every message after it (its own record rides on each) would be
        # dropped for good. No honest node counts that far.
        # An 'alive' record of us that outranks ours (from a previous run of
        # this node, whose last refutation was not saved before it stopped)
        # or that has our incarnation with another address or leaving flag
        # (ours before a restart on a new address) is refuted the same way,
        # as memberlist does: the peers ignored our record, which did not
        # outrank theirs, and kept reaching us where we no longer are.
        # At most one such refutation every STALE_REFUTE_EVERY seconds: two
        # processes sharing one node ID (a copied data directory) would
        # outrank each other for ever, each time saving and telling every
        # peer (found by a review of this rule); a restart needs one or two.
        stale = update.status == "alive" and (
            update.incarnation > self.me.incarnation
            or update.incarnation == self.me.incarnation
            and (update.host, update.port, update.leaving) != (self.me.host, self.me.port, self.me.leaving))
        if stale:
            if now < self._stale_refuted_at + STALE_REFUTE_EVERY:
                return []
            self._stale_refuted_at = now
        if (update.status in ("suspect", "dead") or stale) and update.incarnation >= self.me.incarnation \
                and update.incarnation < MAX_INCARNATION:
            self.me = replace(self.me, incarnation=update.incarnation + 1, status="alive")
            if not stale:  # suspected: maybe our own messages are slow (Lifeguard)
                self.health = min(self.health + 1, self.config.max_health)
            self._enqueue_gossip(self.me)
            # Tell everyone at once rather than wait for gossip: a node that is
            # suspected is usually one whose messages are slow already.
            notice = PushPull((self.me,), reply=False)
            return [Changed(self.me, None),
                    *(Send(m.host, m.port, notice) for m in self.live_peers())]
        return []

    def _store(self, member: Member, previous: Member | None) -> list[Action]:
        self.members[member.id] = member
        self._enqueue_gossip(member)
        if previous is not None and (member.status, member.incarnation, member.host,
                                     member.port, member.leaving) == (
                previous.status, previous.incarnation, previous.host, previous.port,
                previous.leaving):
            return []
        return [Changed(member, previous)]

    # ------------------------------------------------------------ gossip

    def _enqueue_gossip(self, member: Member) -> None:
        self._gossip[member.id] = [member, 0]

    def _piggyback(self, to: Member | None = None) -> tuple[Member, ...]:
        limit = self.config.retransmit_mult * max(1, math.ceil(math.log10(len(self.members) + 2)))
        chosen = sorted(self._gossip.values(), key=lambda entry: entry[1])[:self.config.max_piggyback]
        for entry in chosen:
            entry[1] += 1
            if entry[1] >= limit:
                self._gossip.pop(entry[0].id, None)
        updates = [entry[0] for entry in chosen]
        if to is not None and to.status == "suspect" and not any(u.id == to.id for u in updates):
            # Lifeguard's buddy system: tell a suspect directly, so it can refute in time.
            updates.append(to)
        if not any(u.id == self.me.id for u in updates):
            updates.append(self.me)  # our own record rides along: cheap, keeps addresses fresh
        return tuple(updates)
