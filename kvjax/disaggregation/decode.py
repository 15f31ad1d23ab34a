"""`DecodeServer`: the decode side of disaggregated serving (SGLang's ``--disaggregation-mode decode``).

It runs a scheduler of its own over its own cache, with its own radix tree (and host tier, when
the cache has one), linked to one or more prefill servers (``link``, authenticated; the handshake
compares the model fingerprints and the caches' signatures and refuses a mismatch by name). Per
request (``messages``):

1. :meth:`DecodeServer.submit` sends the prompt to a prefill server (``PrefillOrder``; the router
   picks which, ``router.py``) and keeps the request aside;
2. ``Prefilled`` brings the first token: the request is queued on the scheduler with it as its
   first output token (a request done with it, ``max_new_tokens`` 1 or a stop token, is finished
   at once);
3. admitted (:class:`DecodeTransfers`, the last serving extension: after the tree's match and the
   host tier's load-back), the request's prefix already held here is kept (**decode-side prefix
   reuse**: only tokens ``[prefix, prompt)`` are asked for, ``PullOrder``), slots are allocated
   for the rest, the prefill side offers them (``Offered``), they are pulled through the transfer
   servers straight into device arrays and written into the pools in place (a pending device
   update the scheduler applies before the step), and the request continues from the prompt's
   end: its next step is a decode step;
4. ``Release`` lets the prefill side drop its snapshot.

Faults: a prefill server that closes the link, stalls past ``timeout_s`` (no ``Prefilled``,
``Offered`` or landed pull within it), or offers pieces other than this cache's, fails the request:
every slot it took here is freed, the prefill side is told to release, the request ends with
``abort_reason`` set (``failed`` lists it) and nothing hangs past the bound.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvjax.device_updates import DeviceUpdate
from kvjax.disaggregation.kv_transfer import (
    CacheMovers,
    KVTransferServer,
    TransferTimeout,
    TransferUnreachable,
    pull_units,
)
from kvjax.disaggregation.link import LinkError, PDLink, connect_link
from kvjax.disaggregation.messages import (
    DecodeEvent,
    DecodeEvents,
    Hello,
    LinkedPeers,
    Offered,
    Prefilled,
    PrefillOrder,
    PullOrder,
    PullOutcome,
    Refusal,
    Release,
    Welcome,
)
from kvjax.disaggregation.piece_units import PieceUnits, SideLayout, pool_devices
from kvjax.errors import OutOfMemoryError
from kvjax.multihost import wire
from kvjax.multihost.channel import Channel, LoopbackChannel
from kvjax.multihost.cluster_secret import ClusterSecret
from kvjax.serve.extension import RequestAborted, ServingExtension
from kvjax.serve.serving_req import ServingReq
from kvjax.transfers.request_kv import RequestSpan

__all__ = ["DecodeServer", "DecodeTransfers", "PDRefused", "PrefillPeer", "Room"]

log = logging.getLogger("kvjax.disaggregation")


class PDRefused(Exception):
    """A prefill server refused this decode server at the handshake (``reason`` says why)."""


@dataclasses.dataclass
class PrefillPeer:
    """A linked prefill server: its link (process 0's; None on the other processes of a group),
    the transfer address of each of its processes, its layout and facts from the handshake."""

    address: str
    link: PDLink | None
    name: str
    transfer_addresses: tuple[str, ...]
    page_size: int
    layout: SideLayout
    alive: bool = True
    inbox: list[Any] = dataclasses.field(default_factory=list)
    lost: str = ""  # why the link failed (once not alive)

    def failure(self, timeout_s: float) -> str:
        """Why a request prefilling here failed: the server was lost, or sent nothing in time."""
        if not self.alive:
            return f"prefill server {self.name} at {self.address} was lost: {self.lost}"
        return f"prefill server {self.name} at {self.address} sent no first token within {timeout_s:g} s"


@dataclasses.dataclass
class Room:
    """One request on its way: ``state`` is ``"prefilling"``, ``"queued"`` (on the scheduler,
    waiting for admission and its pull) or ``"pulled"``; times in ``time.perf_counter`` seconds."""

    req: ServingReq
    peer: PrefillPeer
    deadline: float
    state: str = "prefilling"
    first_token: int = -1
    prompt: int = 0
    ordered_at: float = 0.0
    prefilled_at: float = 0.0
    pulled_at: float = 0.0
    decoded_at: float = 0.0  # when its first decode step's token was read
    pulled_tokens: int = 0
    reused_tokens: int = 0
    tried: list[int] = dataclasses.field(default_factory=list)  # prefill servers (indices) given up on


class DecodeServer:
    """The decode side (see the module docstring).

    Args:
        scheduler: the scheduler over this server's cache and model.
        fingerprint: the model's fingerprint (must equal the prefill servers').
        prefill: the prefill servers' bootstrap addresses (``host:port``).
        secret: the cluster secret (default: ``KVJAX_CLUSTER_SECRET``).
        timeout_s: the longest a request waits on its prefill server at each stage.
        name: this server's name in messages.
        kv_heads: distinct KV heads per pool name (default: the plan's).
        channel: the group's channel when this server is a group of processes (each calls with
            its own scheduler over the group's mesh, and makes the same ``submit`` calls; see the
            module docstring); None: one process.
        host: the interface this server's transfer servers bind to (loopback by default).
    """

    def __init__(
        self,
        scheduler: Any,
        *,
        fingerprint: str,
        prefill: Sequence[str],
        secret: ClusterSecret | str | bytes | None = None,
        timeout_s: float = 30.0,
        name: str = "decode",
        kv_heads: dict[str, int] | None = None,
        channel: Channel | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        if not prefill:
            raise ValueError("a decode server needs at least one prefill server's bootstrap address")
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.fingerprint = fingerprint
        self.secret = ClusterSecret.resolve(secret)
        self.timeout_s = float(timeout_s)
        self.name = name
        self.movers = CacheMovers(self.cache, kv_heads)
        self.signature = self.movers.signature()
        self.window = int(self.cache.sliding_window_size or 0)
        self.channel: Channel = channel if channel is not None else LoopbackChannel()
        self.process = int(self.channel.process_id)
        self.devices = pool_devices(self.cache)
        self.layout = SideLayout.of(self.devices)
        self.transfer = KVTransferServer(host)
        self._queued: list[DecodeEvent] = []  # process 0: events for the next exchange
        self.peers = self._link(list(prefill))
        self.rooms: dict[Any, Room] = {}  # by the request's id
        self._names: dict[str, Any] = {}  # a room's name on the link (the id as text) -> the id
        self.failed: list[ServingReq] = []
        self.finished: list[ServingReq] = []
        self.pulled_tokens = 0
        self.reused_tokens = 0
        self.pulls = 0
        self.retried = 0  # prompts sent again to another prefill server (theirs was lost or silent)
        self.transfer_seconds = 0.0
        self._next_peer = itertools.cycle(range(len(self.peers)))
        scheduler.add_extension(DecodeTransfers(self))

    def _link(self, addresses: list[str]) -> list[PrefillPeer]:
        """Process 0 links to every prefill server; a group's other processes learn the peers
        (or the failure, raised the same way) from it."""
        if self.process != 0:
            raw = self.channel.broadcast("pd decode peers")
            linked = wire.decode(raw, LinkedPeers)
            if linked.error_kind == "refused":
                raise PDRefused(linked.error)
            if linked.error_kind:
                raise LinkError(linked.addresses[0] if linked.addresses else "?", linked.error)
            return [_peer(a, None, w) for a, w in zip(linked.addresses, linked.welcomes, strict=True)]
        peers: list[PrefillPeer] = []
        try:
            for address in addresses:
                peers.append(self._connect(address))
        except PDRefused as e:
            self._unlink(peers, LinkedPeers((), (), str(e), "refused"))
            raise
        except LinkError as e:
            self._unlink(peers, LinkedPeers((e.peer,), (), e.reason, "link"))
            raise
        welcomes = tuple(Welcome(p.name, p.transfer_addresses, p.page_size, p.layout.processes) for p in peers)
        self._tell_group(LinkedPeers(tuple(addresses), welcomes))
        return peers

    def _unlink(self, peers: list[PrefillPeer], failure: LinkedPeers) -> None:
        """Process 0 could not link every prefill server: close the links made, tell the group."""
        for peer in peers:
            if peer.link is not None:
                peer.link.close()
        self._tell_group(failure)

    def _tell_group(self, linked: LinkedPeers) -> None:
        if self.channel.num_processes > 1:
            self.channel.broadcast("pd decode peers", wire.encode(linked))

    def _connect(self, address: str) -> PrefillPeer:
        link = connect_link(address, self.secret)
        link.send(Hello(self.fingerprint, self.signature, self.name, self.layout.processes))
        reply = link.receive(self.timeout_s)
        if isinstance(reply, Refusal):
            link.close()
            raise PDRefused(reply.reason)
        if not isinstance(reply, Welcome):
            link.close()
            raise LinkError(address, f"it answered the hello with a {type(reply).__name__}")
        return _peer(address, link, reply)

    # --- requests -------------------------------------------------------------------------------

    def submit(self, reqs: Iterable[ServingReq], prefill: int | None = None) -> None:
        """Send each request's prompt to a prefill server (``prefill``: its index in the addresses
        given; default round robin) and keep the request until its first token comes back."""
        for req in reqs:
            if req.rid in self.rooms or str(req.rid) in self._names:
                raise ValueError(f"request {req.rid!r} is already on its way; request ids must be unique (as text)")
            if req.session_id is not None:
                raise ValueError(f"request {req.rid!r}: sessions are not served across disaggregated servers yet")
            self.scheduler.check_servable([req])
            peer = self._pick(prefill)
            room = Room(req, peer, time.monotonic() + self.timeout_s, ordered_at=time.perf_counter())
            self.rooms[req.rid] = room
            self._names[str(req.rid)] = req.rid
            order = PrefillOrder(str(req.rid), tuple(int(t) for t in req.origin_input_ids), _salt(req.extra_key))
            self._send(peer, order)

    def _pick(self, prefill: int | None) -> PrefillPeer:
        if prefill is not None:
            if not 0 <= prefill < len(self.peers):
                raise ValueError(f"prefill={prefill}: give an index into the {len(self.peers)} prefill servers")
            return self.peers[prefill]
        for _ in range(len(self.peers)):
            peer = self.peers[next(self._next_peer)]
            if peer.alive:
                return peer
        return self.peers[0]  # every one is gone: the request fails at the next step

    @property
    def idle(self) -> bool:
        return not self.rooms and self.scheduler.idle

    def step(self) -> list[ServingReq]:
        """Take what the prefill servers sent, fail what waited too long, run one scheduler step;
        return the requests that ended (finished, or failed with ``abort_reason``)."""
        done: list[ServingReq] = []
        events: list[DecodeEvent] = []
        if self.process == 0:
            for i, peer in enumerate(self.peers):
                self._read(i, peer)
            now = time.monotonic()
            for room in [r for r in self.rooms.values() if r.state == "prefilling" and r.deadline < now]:
                self._queued.append(
                    DecodeEvent("fail", room=str(room.req.rid), error=room.peer.failure(self.timeout_s))
                )
            events, self._queued = self._queued, []
        if self.channel.num_processes > 1:
            raw = self.channel.broadcast("pd decode events", wire.encode(DecodeEvents(tuple(events))))
            events = list(wire.decode(raw, DecodeEvents).events)
        for event in events:
            self._apply(event, done)
        if not self.scheduler.idle:
            ended = self.scheduler.step()
            now = time.perf_counter()
            for room in self.rooms.values():
                if room.state == "pulled" and not room.decoded_at and len(room.req.output_ids) > 1:
                    room.decoded_at = now
            for req in ended:
                self._end(req.rid)
                if req.abort_reason is not None:
                    self.failed.append(req)
                done.append(req)
        if not done and self.rooms and self.scheduler.idle:
            time.sleep(0.002)  # only waiting on prefill servers: do not spin
        self.finished.extend(r for r in done if r.abort_reason is None)
        return done

    def run(self, reqs: Iterable[ServingReq] = (), prefill: int | None = None) -> list[ServingReq]:
        """Submit ``reqs`` and step until every request ended; return them in ending order."""
        self.submit(reqs, prefill)
        done: list[ServingReq] = []
        while not self.idle:
            done += self.step()
        return done

    def leak_free(self) -> bool:
        return self.idle and self.scheduler.leak_free()

    def close(self) -> None:
        for peer in self.peers:
            if peer.link is not None:
                peer.link.close()

    # --- messages -------------------------------------------------------------------------------

    def _read(self, index: int, peer: PrefillPeer) -> None:
        """Process 0: what prefill server ``index`` sent, as events for the next exchange."""
        while peer.inbox:
            self._queued.append(_prefilled_event(index, peer.inbox.pop(0)))
        while peer.alive and peer.link is not None and peer.link.ready():
            try:
                message = peer.link.receive(self.timeout_s)
            except LinkError as e:
                self._peer_lost(peer, str(e))
                return
            if isinstance(message, Prefilled):
                self._queued.append(_prefilled_event(index, message))
            else:
                log.warning("decode %s: %s sent an unexpected %s", self.name, peer.address, type(message).__name__)

    def _apply(self, event: DecodeEvent, done: list[ServingReq]) -> None:
        """Every process: one event process 0 read (``DecodeEvent``)."""
        if event.kind == "lost":
            peer = self.peers[event.peer]
            peer.alive, peer.lost = False, event.error or ""
            for room in [r for r in self.rooms.values() if r.peer is peer and r.state == "prefilling"]:
                self._retry_or_fail(room, peer.failure(self.timeout_s), done)
            return
        if event.kind == "fail":
            failing = self._room(event.room)
            if failing is not None and failing.state == "prefilling":
                self._retry_or_fail(failing, event.error or "failed", done)
            return
        peer = self.peers[event.peer]
        self._handle(peer, Prefilled(event.room, event.first_token, event.prompt_tokens, event.error), done)

    def _handle(self, peer: PrefillPeer, message: Prefilled, done: list[ServingReq]) -> None:
        room = self._room(message.room)
        if room is None or room.peer is not peer or room.state != "prefilling":
            return
        if message.error is not None:
            self._fail(room, message.error, done)
            return
        req = room.req
        room.first_token, room.prompt = int(message.first_token), int(message.prompt_tokens)
        room.prefilled_at = time.perf_counter()
        if room.prompt != len(req.origin_input_ids):
            self._fail(
                room,
                f"prefill server {peer.name} computed {room.prompt} prompt tokens, not {len(req.origin_input_ids)}",
                done,
            )
            return
        req.output_ids.append(room.first_token)
        if req.max_new_tokens <= 1 or room.first_token in req.stop_token_ids:
            self._send(peer, Release(str(req.rid)))
            req.finished = True
            self._end(req.rid)
            done.append(req)
            return
        room.state = "queued"
        self.scheduler.submit([req])

    def _end(self, rid: Any) -> None:
        """Forget request ``rid``'s room (it ended, or failed)."""
        self.rooms.pop(rid, None)
        self._names.pop(str(rid), None)

    def _room(self, name: str) -> Room | None:
        """The room a message names (request ids travel as their text)."""
        rid = self._names.get(name)
        return None if rid is None else self.rooms.get(rid)

    def _send(self, peer: PrefillPeer, message: Any) -> None:
        """Process 0: send ``message`` to ``peer`` (a link that fails loses the peer, at the next
        exchange); elsewhere nothing (process 0 holds the links)."""
        if not peer.alive or peer.link is None:
            return
        try:
            peer.link.send(message)
        except LinkError as e:
            self._peer_lost(peer, str(e))

    def _peer_lost(self, peer: PrefillPeer, why: str) -> None:
        """Process 0: ``peer``'s link failed: close it; every process marks the peer lost (and
        fails the requests prefilling there) at the next exchange."""
        if peer.link is None:
            return
        log.warning("decode %s: lost prefill server %s: %s", self.name, peer.address, why)
        peer.link.close()
        peer.link = None
        self._queued.append(DecodeEvent("lost", self.peers.index(peer), error=why))

    def _retry_or_fail(self, room: Room, reason: str, done: list[ServingReq]) -> None:
        """A prompt whose prefill server was lost or silent past the bound: sent to the next live
        prefill server not tried yet (in the addresses' order after this one), or failed with
        ``reason`` when there is none. Every process decides alike (the peers' states are agreed)."""
        here = self.peers.index(room.peer)
        room.tried.append(here)
        count = len(self.peers)
        order = [(here + k) % count for k in range(1, count)]
        other = next((i for i in order if i not in room.tried and self.peers[i].alive), None)
        if other is None:
            if len(room.tried) > 1:
                names = ", ".join(self.peers[i].name + " at " + self.peers[i].address for i in room.tried[:-1])
                reason = f"{reason} (after {names})"
            self._fail(room, reason, done)
            return
        req = room.req
        self._send(room.peer, Release(str(req.rid)))  # what it may still compute is not wanted
        log.warning(
            "decode %s: request %r retried on prefill server %s: %s",
            self.name,
            req.rid,
            self.peers[other].address,
            reason,
        )
        room.peer = self.peers[other]
        room.deadline = time.monotonic() + self.timeout_s
        room.ordered_at = time.perf_counter()
        self.retried += 1
        self._send(
            room.peer, PrefillOrder(str(req.rid), tuple(int(t) for t in req.origin_input_ids), _salt(req.extra_key))
        )

    def _fail(self, room: Room, reason: str, done: list[ServingReq]) -> None:
        req = room.req
        self._end(req.rid)
        self._send(room.peer, Release(str(req.rid)))
        req.abort_reason = reason
        req.finished = True
        self.failed.append(req)
        done.append(req)

    def await_offer(self, room: Room, deadline: float) -> Offered:
        """The prefill server's answer to a pull order for ``room`` (others that arrive meanwhile
        are kept for the next step); ``LinkError`` or ``TimeoutError`` past ``deadline``."""
        peer = room.peer
        if peer.link is None:
            raise LinkError(peer.address, "the link is closed")
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"prefill server {peer.name} offered nothing within {self.timeout_s:g} s")
            if not peer.link.ready(min(remaining, 0.05)):
                continue
            message = peer.link.receive(remaining)
            if isinstance(message, Offered) and message.room == str(room.req.rid):
                return message
            peer.inbox.append(message)


class DecodeTransfers(ServingExtension):
    """Pulls an admitted disaggregated request's KV (see the module docstring, step 3)."""

    def __init__(self, server: DecodeServer) -> None:
        self.server = server
        self.scheduler: Any = None

    def attach(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def after_admit(self, req: ServingReq) -> None:
        server = self.server
        room = server.rooms.get(req.rid)
        if room is None or room.state != "queued":
            return
        cache, sched = server.cache, self.scheduler
        prefix, prompt = int(req.cache_protected_len), room.prompt
        room.reused_tokens = min(prefix, prompt)
        if prefix >= prompt:  # the whole prompt is held here already
            room.state = "pulled"
            room.pulled_at = time.perf_counter()
            server._send(room.peer, Release(str(req.rid)))
            server.reused_tokens += prompt
            return
        alloc = cache.token_to_kv_pool_allocator
        ps = alloc.page_size
        need = -(-(prompt - prefix) // ps) * ps
        if not sched.make_room(sched.reserved_tokens + need + ps):
            raise OutOfMemoryError(
                f"no room for the {need} pulled tokens of request {req.rid!r} on decode server {server.name}"
            )
        slots = alloc.alloc(need)
        if slots is None:
            raise OutOfMemoryError(
                f"no room for the {need} pulled tokens of request {req.rid!r} on decode server {server.name}"
            )
        try:
            self._pull(room, req, prefix, prompt, slots)
        except (LinkError, TimeoutError, TransferTimeout, ValueError, RuntimeError) as e:
            alloc.free(slots)
            if isinstance(e, LinkError):
                room.peer.alive, room.peer.lost = False, e.reason  # on every process alike
                if room.peer.link is not None:
                    room.peer.link.close()
                    room.peer.link = None
                for other in server.rooms.values():  # those waiting for their first token fail next step
                    if other.peer is room.peer and other.state == "prefilling":
                        other.deadline = 0.0
            server._send(room.peer, Release(str(req.rid)))
            server._end(req.rid)
            raise RequestAborted(
                f"the KV of request {req.rid!r} could not be moved from prefill server {room.peer.name} at "
                f"{room.peer.address}: {e}"
            ) from None
        cache.req_to_token_pool.write(req.req_pool_idx, prefix, slots[: prompt - prefix])
        req.kv_committed_len = prompt
        room.state = "pulled"
        room.pulled_at = time.perf_counter()
        room.pulled_tokens = prompt - prefix
        server.pulled_tokens += prompt - prefix
        server.reused_tokens += prefix
        server.pulls += 1
        server._send(room.peer, Release(str(req.rid)))

    def _offer(self, room: Room, req: ServingReq, prefix: int, deadline: float) -> Offered:
        """The prefill server's answer to the pull order for ``room`` (process 0 asks; a group's
        other processes learn it from process 0). ``LinkError`` when the link failed (the peer is
        lost on every process), ``TimeoutError`` past ``deadline``, ``RuntimeError`` for an offer
        the prefill server refused."""
        server = self.server
        peer = room.peer
        if server.process == 0:
            try:
                if not peer.alive or peer.link is None:
                    raise LinkError(peer.address, "the link is closed")
                peer.link.send(PullOrder(str(req.rid), prefix, server.window))
                outcome = PullOutcome((server.await_offer(room, deadline),))
            except LinkError as e:
                outcome = PullOutcome(error=e.reason, lost=True)
            except TimeoutError as e:
                outcome = PullOutcome(error=str(e))
        else:
            outcome = PullOutcome()
        if server.channel.num_processes > 1:
            outcome = wire.decode(server.channel.broadcast("pd decode offer", wire.encode(outcome)), PullOutcome)
        if outcome.lost:
            raise LinkError(peer.address, outcome.error)
        if outcome.error:
            raise TimeoutError(outcome.error)
        offered = outcome.offered[0]
        if offered.error is not None:
            raise RuntimeError(f"prefill server {peer.name}: {offered.error}")
        return offered

    def _pull(self, room: Room, req: ServingReq, prefix: int, prompt: int, slots: np.ndarray) -> None:
        server = self.server
        deadline = time.monotonic() + server.timeout_s
        peer = room.peer
        offered = self._offer(room, req, prefix, deadline)
        if (offered.start, offered.end) != (prefix, prompt):
            raise ValueError(f"offered tokens [{offered.start}, {offered.end}), asked for [{prefix}, {prompt})")
        span = _decode_span(server.cache, req, prefix, prompt, offered.window_start, slots)
        mine = server.movers.pieces(span)
        theirs = [(p.pool, p.name, tuple(p.shape), p.dtype) for p in offered.pieces]
        if theirs != [(pool, s.name, tuple(s.shape), s.dtype) for pool, s in mine]:
            raise ValueError(
                f"the offered pieces {theirs} are not this cache's "
                f"{[(pool, s.name, s.shape, s.dtype) for pool, s in mine]}"
            )
        plan = PieceUnits(tuple(spec for _, spec in mine), peer.layout, server.layout)
        units = [plan.units(i) for i in range(len(mine))]
        if [p.units for p in offered.pieces] != units:
            raise ValueError(f"the offer cuts the pieces into {[p.units for p in offered.pieces]} units, not {units}")
        started = time.perf_counter()
        error = ""
        try:
            arrays = pull_units(
                server.transfer,
                offered.transfer_id,
                plan,
                peer.transfer_addresses,
                server.devices,
                server.process,
                deadline,
            )
        except (TransferTimeout, TransferUnreachable, RuntimeError, ValueError) as e:
            error = (
                f"{type(e).__name__}: {e}" if server.channel.num_processes == 1 else f"process {server.process}: {e}"
            )
        if server.channel.num_processes > 1:  # every process's pull landed, or none writes
            errors = [raw.decode() for raw in server.channel.all_gather("pd decode pulled", error.encode())]
            error = next((e for e in errors if e), "")
        if error:
            raise RuntimeError(error)
        server.transfer_seconds += time.perf_counter() - started
        movers = server.movers

        def write(pools: Any) -> Any:
            return movers.scatter(pools, arrays, span)

        pages = np.unique(np.asarray(slots) // server.cache.token_to_kv_pool_allocator.page_size)
        server.cache.pending.record(DeviceUpdate("disaggregated pull", movers.movers[0].name, pages, write))


def _peer(address: str, link: PDLink | None, welcome: Welcome) -> PrefillPeer:
    return PrefillPeer(
        address,
        link,
        welcome.name,
        tuple(welcome.transfer_addresses),
        welcome.page_size,
        SideLayout(tuple(welcome.device_processes)),
    )


def _prefilled_event(peer: int, message: Prefilled) -> DecodeEvent:
    return DecodeEvent("prefilled", peer, message.room, message.first_token, message.prompt_tokens, message.error)


def _decode_span(
    cache: Any, req: ServingReq, start: int, end: int, window_start: int, slots: np.ndarray
) -> RequestSpan:
    """The decode side's span: the fresh ``slots`` for tokens ``[start, end)``."""
    own = np.asarray(slots[: end - start], np.int32)
    alloc = cache.token_to_kv_pool_allocator
    swa = None
    if hasattr(alloc, "translate_loc_from_full_to_swa"):
        swa = np.asarray(alloc.translate_loc_from_full_to_swa(own[window_start - start :]), np.int32)
    return RequestSpan(start, end, own, window_start, swa, req.mamba_pool_idx)


def _salt(extra_key: Any) -> str | None:
    if extra_key is None:
        return None
    if not isinstance(extra_key, str):
        raise ValueError(f"extra_key={extra_key!r}: a disaggregated request's namespace is a string (a cache salt)")
    return extra_key
