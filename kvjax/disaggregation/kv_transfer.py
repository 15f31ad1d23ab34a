"""A request's cache as pieces, offered and pulled between servers through JAX's transfer server.

``CacheMovers`` walks a cache's device pools and asks each one's pool kind how a request's share
of it moves (its registered ``RequestKV``, ``kvjax.pools.registry.request_kv_of``): there is no
branch per kind here. ``KVTransferServer`` wraps ``jax.experimental.transfer``: the prefill side
offers arrays under a transfer id (``await_pull``), the decode side pulls them into its own
devices with the same shard count (``connect(address).pull``), every pull bounded by a deadline.

The shard count of a piece is agreed from facts both sides exchanged in the handshake
(:func:`agreed_shards`: the greatest common divisor of both sides' head shards and the piece's
head axis), so each side computes the same sharding without another message; a piece without a
head axis moves whole, on one device. On the decode side the pulled pieces are laid onto the
pool's own sharding (a device-to-device copy) and written in place (``RequestKV.scatter``).
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from kvjax.disaggregation.messages import PieceMessage
from kvjax.plan.draft import DRAFT_POOL_NAME
from kvjax.pools.registry import request_kv_of
from kvjax.transfers.request_kv import PieceSpec, RequestSpan, head_shards

__all__ = [
    "CacheMovers",
    "KVTransferServer",
    "TransferTimeout",
    "TransferUnreachable",
    "agreed_shards",
    "piece_message",
    "transfer_sharding",
]


class TransferTimeout(Exception):
    """A pull did not land before its deadline."""


class TransferUnreachable(RuntimeError):
    """The transfer server to pull from refuses connections (its process is gone)."""


@dataclass(frozen=True)
class PoolMover:
    """One device pool of a cache and how a request's share of it moves."""

    name: str
    kind: str
    mover: Any  # RequestKV
    kv_heads: int


class CacheMovers:
    """Every device pool of ``cache`` with its pool kind's ``RequestKV`` (in the pools' name order).

    ``kv_heads``: the model's distinct KV heads per pool name (default: the plan's target's for
    every pool but a draft model's pool ``kv_draft``, which takes the draft's: its pool's heads over
    the draft's own ``kv_head_replicas``). ``NotImplementedError`` names a pool whose kind cannot
    move (nothing registered)."""

    def __init__(self, cache: Any, kv_heads: Mapping[str, int] | None = None) -> None:
        plan = cache.plan
        target = plan.target
        heads = max(1, target.num_kv_heads_per_rank * target.attn_tp_size // max(1, target.kv_head_replicas))
        kinds = {p.name: p.kind for p in plan.pools if p.memory == "device"}
        self.cache = cache
        self.movers: list[PoolMover] = []
        for name in cache.pools.names:
            kind = kinds.get(name, name)  # grouped pool kinds are stored under the kind's name
            mover = request_kv_of(kind)
            default = heads
            if name == DRAFT_POOL_NAME and plan.draft is not None:
                held = getattr(cache.pools[name], "num_kv_heads", None)
                default = heads if held is None else max(1, int(held) // max(1, plan.draft.kv_head_replicas))
            self.movers.append(PoolMover(name, kind, mover, int((kv_heads or {}).get(name, default))))

    def pieces(self, span: RequestSpan) -> list[tuple[str, PieceSpec]]:
        """``(pool name, piece)`` of every pool for ``span``, in order."""
        pools = self.cache.pools
        return [(m.name, p) for m in self.movers for p in m.mover.pieces(pools[m.name], span, m.kv_heads)]

    def signature(self) -> tuple[str, ...]:
        """Each piece's pool, name, per-token shape (token axis 1) and dtype, and each pool's
        layout facts (``RequestKV.layout``, when its kind has one: the recurrent state's TP split):
        what both sides of a link must agree on (the handshake compares them)."""
        span = RequestSpan(0, 1, np.zeros(1, np.int32), 0, np.zeros(1, np.int32), 1)
        pieces = tuple(f"{pool}.{p.name}{list(p.shape)}:{p.dtype}" for pool, p in self.pieces(span))
        facts = tuple(
            f"{m.name}: {fact}"
            for m in self.movers
            if hasattr(m.mover, "layout")
            for fact in m.mover.layout(self.cache.pools[m.name])
        )
        return pieces + facts

    def head_shards(self) -> int:
        """Devices the cache's KV heads are split over (the handshake's fact)."""
        return max((head_shards(getattr(self.cache.pools[m.name], "mesh", None), "tp") for m in self.movers), default=1)

    def gather(self, pools: Any, span: RequestSpan) -> list[jax.Array]:
        """Every pool's pieces of ``span`` from ``pools`` (read only), in :meth:`pieces` order."""
        return [a for m in self.movers for a in m.mover.gather(pools[m.name], span, m.kv_heads)]

    def scatter(self, pools: Any, arrays: Sequence[jax.Array], span: RequestSpan) -> Any:
        """``pools`` with every pool's pieces written at ``span`` (the pools donated)."""
        rest = list(arrays)
        updates = {}
        for m in self.movers:
            pool = pools[m.name]
            count = len(m.mover.pieces(pool, span, m.kv_heads))
            updates[m.name] = m.mover.scatter(pool, rest[:count], span, m.kv_heads)
            rest = rest[count:]
        return pools.replace(**updates)


def agreed_shards(spec: PieceSpec, mine: int, theirs: int) -> int:
    """Devices piece ``spec`` is split over on the way (both sides compute the same)."""
    if spec.head_axis is None:
        return 1
    return math.gcd(math.gcd(int(mine), int(theirs)), int(spec.shape[spec.head_axis]))


def transfer_sharding(shape: Sequence[int], head_axis: int | None, shards: int) -> Any:
    """The sharding a piece travels in: split over this process's first ``shards`` devices along
    ``head_axis``, or whole on its first device."""
    devices = jax.local_devices()
    if head_axis is None or shards <= 1:
        return SingleDeviceSharding(devices[0])
    if shards > len(devices):
        raise ValueError(f"a piece split over {shards} devices; this process has {len(devices)}")
    mesh = Mesh(np.asarray(devices[:shards]), ("transfer",))
    parts: list[str | None] = [None] * len(shape)
    parts[head_axis] = "transfer"
    return NamedSharding(mesh, P(*parts))


def piece_message(pool: str, spec: PieceSpec, shards: int) -> PieceMessage:
    return PieceMessage(
        pool,
        spec.name,
        tuple(int(s) for s in spec.shape),
        spec.dtype,
        -1 if spec.head_axis is None else spec.head_axis,
        shards,
    )


class KVTransferServer:
    """This process's transfer server (``jax.experimental.transfer``) on ``host``; ``address``
    is what the other side connects to. ``offer`` keeps the offered arrays alive until
    :meth:`drop` (the pull copies them out)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        from jax.experimental import transfer

        client = jax.local_devices()[0].client
        self._server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self.address: str = self._server.address()
        self._connections: dict[str, Any] = {}
        self._offered: dict[int, list[jax.Array]] = {}
        self.bytes_pulled = 0
        self.bytes_offered = 0

    def offer(self, transfer_id: int, arrays: Sequence[jax.Array]) -> None:
        arrays = list(arrays)
        self._offered[transfer_id] = arrays
        self.bytes_offered += sum(int(a.nbytes) for a in arrays)
        self._server.await_pull(int(transfer_id), arrays)

    def drop(self, transfer_id: int) -> None:
        """Forget an offer (pulled, or given up on by the other side)."""
        self._offered.pop(transfer_id, None)

    @property
    def offers(self) -> int:
        return len(self._offered)

    def pull(
        self, address: str, transfer_id: int, structs: Sequence[jax.ShapeDtypeStruct], timeout_s: float
    ) -> list[jax.Array]:
        """Pull offer ``transfer_id`` from the transfer server at ``address`` into ``structs``'
        shardings; ``TransferUnreachable`` at once when nothing listens at ``address`` (no pull
        started), ``TransferTimeout`` when it has not landed within ``timeout_s`` (the pull is
        left to a daemon thread), any other failure as raised."""
        _reachable(address, min(timeout_s, 2.0))
        connection = self._connections.get(address)
        if connection is None:
            connection = self._connections[address] = self._server.connect(address)
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                arrays = connection.pull(int(transfer_id), list(structs))
                result["arrays"] = jax.block_until_ready(arrays)
            except Exception as e:  # the pull's error is the caller's to report
                result["error"] = e

        thread = threading.Thread(target=run, name=f"kv pull {transfer_id}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TransferTimeout(
                f"the pull of transfer {transfer_id} from {address} did not land within {timeout_s:g} s"
            )
        if "error" in result:
            raise result["error"]
        arrays = list(result["arrays"])
        self.bytes_pulled += sum(int(a.nbytes) for a in arrays)
        return arrays


def _reachable(address: str, timeout_s: float) -> None:
    """``TransferUnreachable`` when nothing accepts a connection at ``address`` (``host:port``).

    Checked before each pull: a pull from a transfer server that is gone does not fail, it retries
    its connection until the deadline, and the thread left waiting in it aborts the process when
    the interpreter exits (``terminate called ...``, the runtime tearing the transfer library down
    under it). A server that dies after this check can still leave such a thread."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=max(timeout_s, 0.01)):
            pass
    except OSError as e:
        raise TransferUnreachable(
            f"the transfer server at {address} cannot be reached ({e}): its process is gone"
        ) from None
