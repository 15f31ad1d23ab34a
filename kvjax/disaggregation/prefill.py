"""`PrefillServer`: the prefill side of disaggregated serving (SGLang's ``--disaggregation-mode
prefill``).

It serves a scheduler of its own (its pools, its radix tree: prompts share prefixes here as on any
server) and a bootstrap endpoint (``--disaggregation-bootstrap-port``) where decode servers connect
(``link``: authenticated). Per request, in order (``messages``):

1. a ``PrefillOrder`` is queued as a request with ``max_new_tokens=1``;
2. when its prompt is computed, the request is finishing: :class:`PrefillSnapshots` (a serving
   extension, called before the request's KV goes to the tree) gathers the request's pieces of
   every pool (``kv_transfer.CacheMovers``) into a snapshot of its own (device arrays, a copy:
   the pool's pages go to the tree and may be evicted at once), and ``Prefilled`` tells the decode
   side its first token;
3. a ``PullOrder`` for tokens ``[start, prompt)`` offers that part of the snapshot on the transfer
   server (on the device, in the agreed sharding) under the decode side's transfer id;
4. ``Release`` (or the snapshot's time to live, ``snapshot_ttl_s``) drops the snapshot and the
   offer.

Everything runs on the caller's thread (:meth:`serve_once` / :meth:`serve`): reads of the
sockets are bounded, a decode server that misbehaves is disconnected and named in the log.

**A group of processes** (``channel``: the side is one ``jax.distributed`` group, its pools on one
mesh over every process's devices): every process runs a `PrefillServer` over its scheduler, and
the processes stay in step as multi-process serving does. Process 0 alone holds the bootstrap
endpoint and the links; what it reads (hellos accepted, orders, pull orders, releases, links
dropped, snapshots expired, the stop) travels to every process once per loop
(``PrefillEvents``, the group's channel) and every process applies it in the same order, so
every process submits the same requests, takes the same snapshots (a collective) and offers the
same pull. Each process runs its own transfer server and offers the units of each pull its
devices hold (``piece_units``: each unit offered by exactly one process); the ``Welcome`` gives
the decode side every process's transfer address and the side's layout.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from kvjax.disaggregation.kv_transfer import (
    TRANSFER_ID_STRIDE,
    CacheMovers,
    KVTransferServer,
    offer_units,
    piece_message,
)
from kvjax.disaggregation.link import LinkError, PDLink, accept_link, listen
from kvjax.disaggregation.messages import (
    Hello,
    Offered,
    Prefilled,
    PrefillEvent,
    PrefillEvents,
    PrefillOrder,
    PullOrder,
    Refusal,
    Release,
    Welcome,
)
from kvjax.disaggregation.piece_units import PieceUnits, SideLayout, pool_devices
from kvjax.multihost import wire
from kvjax.multihost.channel import Channel, LoopbackChannel
from kvjax.multihost.cluster_secret import ClusterSecret
from kvjax.serve.extension import ServingExtension
from kvjax.serve.serving_req import ServingReq
from kvjax.transfers.request_kv import PieceSpec, RequestSpan

__all__ = ["PrefillServer", "PrefillSnapshots", "Snapshot"]

log = logging.getLogger("kvjax.disaggregation")


@dataclasses.dataclass
class Snapshot:
    """A computed prompt's pieces (tokens ``[0, prompt)``; window pieces from ``window_start``)."""

    prompt: int
    window_start: int
    specs: list[tuple[str, PieceSpec]]
    arrays: list[jax.Array]
    first_token: int = -1
    expires: float = 0.0
    transfer_ids: list[int] = dataclasses.field(default_factory=list)


def request_span(cache: Any, req: ServingReq, start: int, end: int, window_start: int) -> RequestSpan:
    """Where tokens ``[start, end)`` of ``req`` live in ``cache`` (its row, the SWA mapping, its
    state slot)."""
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    slots = np.asarray(row[start:end], np.int32).copy()
    alloc = cache.token_to_kv_pool_allocator
    window_start = max(window_start, start)
    swa_slots = None
    if hasattr(alloc, "translate_loc_from_full_to_swa"):
        swa_slots = np.asarray(alloc.translate_loc_from_full_to_swa(row[window_start:end]), np.int32)
    return RequestSpan(start, end, slots, window_start, swa_slots, req.mamba_pool_idx)


def _window_kept_from(cache: Any, req: ServingReq, first: int) -> int:
    """The first token of ``[first, prompt)`` from which every token still has its sliding-window
    slot. ``req.swa_evicted_seqlen`` does not say it: it starts at the tree's protected prefix,
    whose window slots the tree still holds (locked) after a chunked prefill inserted it; a freed
    slot is unpaired (0) in the allocator's mapping, or 0 in the row of a pure sliding-window cache."""
    prompt = len(req.origin_input_ids)
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx][first:prompt]
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.translate_loc_from_full_to_swa(row) if hasattr(alloc, "translate_loc_from_full_to_swa") else row
    freed = np.flatnonzero(np.asarray(slots) <= 0)
    return first if freed.size == 0 else first + int(freed[-1]) + 1


class PrefillSnapshots(ServingExtension):
    """Takes the snapshot of each disaggregated request as its prompt is done (``before_release``
    of a finished request): see the module docstring."""

    def __init__(self, server: PrefillServer) -> None:
        self.server = server

    def before_release(self, req: ServingReq, finished: bool) -> None:
        server = self.server
        key = req.rid
        if not finished or key not in server.orders:
            return
        cache = server.cache
        prompt = len(req.origin_input_ids)
        window = cache.sliding_window_size or 0
        window_start = _window_kept_from(cache, req, max(0, prompt - window)) if window else 0
        span = request_span(cache, req, 0, prompt, window_start)
        pools = cache.pending.read(server.movers.movers[0].name) if cache.pending is not None else cache.pools
        server.snapshots[key] = Snapshot(
            prompt, span.window_start, server.movers.pieces(span), server.movers.gather(pools, span)
        )


class PrefillServer:
    """The prefill side (see the module docstring).

    Args:
        scheduler: the scheduler over this server's cache and model.
        fingerprint: the model's fingerprint (``kvjax.serve.model_fingerprint``); a decode server
            with another is refused.
        secret: the cluster secret both sides hold (default: ``KVJAX_CLUSTER_SECRET``).
        host, port: the bootstrap endpoint (port 0: a free one; ``address`` says which).
        snapshot_ttl_s: how long a computed prompt waits for its pull before it is dropped.
        name: this server's name in messages.
        channel: the group's channel when this server is a group of processes (each calls with
            its own scheduler over the group's mesh; see the module docstring); None: one process.
    """

    def __init__(
        self,
        scheduler: Any,
        *,
        fingerprint: str,
        secret: ClusterSecret | str | bytes | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        snapshot_ttl_s: float = 60.0,
        name: str = "prefill",
        kv_heads: dict[str, int] | None = None,
        channel: Channel | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.fingerprint = fingerprint
        self.secret = ClusterSecret.resolve(secret)
        self.name = name
        self.snapshot_ttl_s = float(snapshot_ttl_s)
        self.channel: Channel = channel if channel is not None else LoopbackChannel()
        self.process = int(self.channel.process_id)
        self.movers = CacheMovers(self.cache, kv_heads)
        self.signature = self.movers.signature()
        self.devices = pool_devices(self.cache)
        self.layout = SideLayout.of(self.devices)
        self.listener: socket.socket | None = listen(host, port) if self.process == 0 else None
        mine = f"{host}:{self.listener.getsockname()[1]}" if self.listener is not None else ""
        self.address = self.channel.broadcast("pd prefill address", mine.encode()).decode()
        self.transfer = KVTransferServer(host)
        gathered = self.channel.all_gather("pd prefill transfer", self.transfer.address.encode())
        self.transfer_addresses = tuple(a.decode() for a in gathered)
        self.links: dict[int, PDLink] = {}  # process 0's links, by number
        self._greeted: set[int] = set()  # links whose hello process 0 accepted
        self._next_link = 0
        self._welcomed: dict[int, SideLayout] = {}  # link -> the decode side's layout (every process)
        self.orders: dict[tuple[int, str], int] = {}  # (link, room) -> link
        self.snapshots: dict[tuple[int, str], Snapshot] = {}
        self.prefilled = 0
        # fresh per server (agreed by the group), then counted in strides (one id per receiving process)
        base = secrets.randbelow(1 << 30) << 16
        self._next_transfer = int(self.channel.broadcast("pd prefill ids", str(base).encode()).decode())
        self.offered_tokens = 0
        self._queued: list[PrefillEvent] = []  # process 0: events for the next exchange
        #: test and fault hooks: seconds to sleep before answering a pull (a stalled server)
        self.stall_pull_s = 0.0
        scheduler.add_extension(PrefillSnapshots(self))

    # --- the loop -------------------------------------------------------------------------------

    def serve(self, stop: Callable[[], bool] = lambda: False, poll_s: float = 0.05) -> None:
        """Serve until ``stop()`` says so (checked between steps; a group stops when its process
        0's does)."""
        while self.serve_once(poll_s, stop()):
            pass

    def serve_once(self, poll_s: float = 0.0, stop: bool = False) -> bool:
        """Read what arrived (waiting up to ``poll_s`` when there is nothing to compute), run one
        scheduler step if any request is queued, answer what finished, drop expired snapshots.
        In a group, process 0 reads and every process applies what it read, in order. False once
        the server stops (``stop`` on process 0)."""
        events: list[PrefillEvent] = []
        if self.process == 0:
            self._read_links(poll_s)
            self._expire()
            events, self._queued = self._queued, []
            if stop:
                events.append(PrefillEvent("stop"))
        if self.channel.num_processes > 1:
            raw = self.channel.broadcast("pd prefill events", wire.encode(PrefillEvents(tuple(events))))
            events = list(wire.decode(raw, PrefillEvents).events)
        for event in events:
            if event.kind == "stop":
                return False
            self._apply(event)
        if not self.scheduler.idle:
            for req in self.scheduler.step():
                self._prefilled(req)
        return True

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
        if self.listener is not None:
            self.listener.close()

    # --- process 0: the links -------------------------------------------------------------------

    def _read_links(self, poll_s: float) -> None:
        import select

        assert self.listener is not None
        busy = not self.scheduler.idle or bool(self._queued)
        numbers = {id(link): n for n, link in self.links.items()}
        sockets: list[Any] = [self.listener, *self.links.values()]
        readable, _, _ = select.select(sockets, [], [], 0.0 if busy else poll_s)
        for ready in readable:
            if ready is self.listener:
                self._accept()
            elif numbers[id(ready)] in self.links:
                self._read(numbers[id(ready)])

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            link = accept_link(self.listener, self.secret)
        except LinkError as e:
            log.warning("prefill %s: refused a connection: %s", self.name, e)
            return
        self.links[self._next_link] = link
        self._next_link += 1

    def _drop_link(self, link: int, why: str) -> None:
        """Process 0: close link ``link`` (every process forgets it at the next exchange)."""
        # a decode server that went away is routine; anything else (a refusal, a bad frame) is not
        level = logging.INFO if why.endswith("its connection closed") else logging.WARNING
        log.log(level, "prefill %s: %s", self.name, why)
        held = self.links.pop(link, None)
        if held is None:
            return
        held.close()
        self._greeted.discard(link)
        self._queued.append(PrefillEvent("drop", link))

    def _read(self, link: int) -> None:
        held = self.links[link]
        try:
            message = held.receive(timeout_s=5.0)
        except LinkError as e:
            self._drop_link(link, str(e))
            return
        if isinstance(message, Hello):
            self._hello(link, message)
        elif link not in self._greeted:
            self._drop_link(link, f"{held.peer} sent {type(message).__name__} before its hello")
        elif isinstance(message, PrefillOrder):
            self._queued.append(PrefillEvent("order", link, message.room, message.input_ids, message.extra_key))
        elif isinstance(message, PullOrder):
            self._queued.append(PrefillEvent("pull", link, message.room, start=message.start, window=message.window))
        elif isinstance(message, Release):
            self._queued.append(PrefillEvent("release", link, message.room))
        else:
            self._drop_link(link, f"{held.peer} sent a {type(message).__name__}, which a decode server never sends")

    def _hello(self, link: int, hello: Hello) -> None:
        reason = None
        if hello.fingerprint != self.fingerprint:
            reason = f"model fingerprint {hello.fingerprint!r} differs from this server's {self.fingerprint!r}"
        elif hello.signature != self.signature:
            theirs, mine = set(hello.signature), set(self.signature)
            reason = (
                f"the caches differ: the decode side has {sorted(theirs - mine)} and lacks {sorted(mine - theirs)} "
                "(layers, dtypes, KV heads or the recurrent state's TP split)"
            )
        if reason is not None:
            peer = self.links[link].peer
            self._send(link, Refusal(f"prefill server {self.name}: {reason}"))
            self._drop_link(link, f"refused decode server {hello.name!r} at {peer}: {reason}")
            return
        self._greeted.add(link)
        self._queued.append(PrefillEvent("welcome", link, device_processes=tuple(hello.device_processes)))
        page_size = int(self.cache.token_to_kv_pool_allocator.page_size)
        self._send(link, Welcome(self.name, self.transfer_addresses, page_size, self.layout.processes))

    def _send(self, link: int, message: Any) -> None:
        """Process 0: send ``message`` on link ``link`` (a link that fails is dropped); elsewhere
        nothing (process 0 holds the links)."""
        held = self.links.get(link) if self.process == 0 else None
        if held is None:
            return
        try:
            held.send(message)
        except LinkError as e:
            self._drop_link(link, str(e))

    # --- every process: what process 0 read ------------------------------------------------------

    def _apply(self, event: PrefillEvent) -> None:
        if event.kind == "welcome":
            self._welcomed[event.link] = SideLayout(tuple(event.device_processes))
        elif event.kind == "order":
            self._order(event.link, PrefillOrder(event.room, event.input_ids, event.extra_key))
        elif event.kind == "pull":
            if event.link in self._welcomed:
                self._pull(event.link, PullOrder(event.room, event.start, event.window))
        elif event.kind == "release":
            self._release((event.link, event.room))
        elif event.kind == "drop":
            self._welcomed.pop(event.link, None)
            for key in [k for k in self.snapshots if k[0] == event.link]:
                self._release(key)
            for key in [k for k in self.orders if k[0] == event.link]:
                self.orders.pop(key)

    def _order(self, link: int, order: PrefillOrder) -> None:
        key = (link, order.room)
        if key in self.orders or key in self.snapshots:
            self._send(link, Prefilled(order.room, error=f"room {order.room!r} is already in use on this link"))
            return
        req = ServingReq(key, np.asarray(order.input_ids, np.int32), max_new_tokens=1, extra_key=order.extra_key)
        try:
            self.scheduler.submit([req])
        except Exception as e:  # refused before queueing (too long, never fits)
            self._send(link, Prefilled(order.room, error=f"prefill server {self.name} refused the prompt: {e}"))
            return
        self.orders[key] = link

    def _prefilled(self, req: ServingReq) -> None:
        key: tuple[int, str] = req.rid  # type: ignore[assignment]  # this server's requests' ids
        link = self.orders.pop(key, None)
        if link is None:
            return
        snapshot = self.snapshots.get(key)
        if snapshot is None:
            self._send(
                link, Prefilled(key[1], error=f"prefill server {self.name}: no snapshot of the prompt was taken")
            )
            return
        snapshot.first_token = int(req.output_ids[0])
        snapshot.expires = time.monotonic() + self.snapshot_ttl_s
        self.prefilled += 1
        self._send(link, Prefilled(key[1], snapshot.first_token, snapshot.prompt))

    def _pull(self, link: int, order: PullOrder) -> None:
        key = (link, order.room)
        snapshot = self.snapshots.get(key)
        if snapshot is None:
            self._send(link, Offered(order.room, -1, error=f"room {order.room!r} holds no computed prompt"))
            return
        transfer_id = self._next_transfer
        self._next_transfer += TRANSFER_ID_STRIDE
        if self.stall_pull_s:
            time.sleep(self.stall_pull_s)
        start, end = int(order.start), snapshot.prompt
        window_start = max(start, snapshot.window_start)
        if order.window:
            needed = max(start, end - int(order.window))
            if needed < snapshot.window_start:
                why = f"the window from token {needed} was freed here (kept from {snapshot.window_start})"
                self._send(link, Offered(order.room, transfer_id, error=why))
                return
        if not 0 <= start <= end:
            self._send(link, Offered(order.room, transfer_id, error=f"start {start} is outside the prompt of {end}"))
            return
        arrays, specs = [], []
        for (_, spec), array in zip(snapshot.specs, snapshot.arrays, strict=True):
            if spec.token_axis is not None:
                first = (window_start - snapshot.window_start) if spec.window else start
                index = [slice(None)] * len(spec.shape)
                index[spec.token_axis] = slice(first, None)
                array = array[tuple(index)]
            arrays.append(array)
            specs.append(dataclasses.replace(spec, shape=tuple(array.shape)))
        theirs = self._welcomed[link]
        plan = PieceUnits(tuple(specs), self.layout, theirs)
        offer_units(self.transfer, transfer_id, plan, arrays, self.devices, self.process)
        snapshot.transfer_ids.extend(transfer_id + r for r in theirs.process_ids)
        self.offered_tokens += end - start
        messages = tuple(
            piece_message(pool, spec, plan.units(i))
            for i, ((pool, _), spec) in enumerate(zip(snapshot.specs, specs, strict=True))
        )
        self._send(link, Offered(order.room, transfer_id, start, end, window_start, messages))

    def _release(self, key: tuple[int, str]) -> None:
        snapshot = self.snapshots.pop(key, None)
        if snapshot is not None:
            for transfer_id in snapshot.transfer_ids:
                self.transfer.drop(transfer_id)

    def _expire(self) -> None:
        """Process 0: release the snapshots not pulled within their time to live (at the next
        exchange, on every process)."""
        now = time.monotonic()
        for key in [k for k, s in self.snapshots.items() if s.first_token >= 0 and s.expires < now]:
            if any(e.kind == "release" and (e.link, e.room) == key for e in self._queued):
                continue
            log.warning(
                "prefill %s: room %r was not pulled within %g s; dropped", self.name, key[1], self.snapshot_ttl_s
            )
            self._queued.append(PrefillEvent("release", key[0], key[1]))
