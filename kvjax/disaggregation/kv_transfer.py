"""A request's cache as pieces, offered and pulled between servers through JAX's transfer server.

``CacheMovers`` walks a cache's device pools and asks each one's pool kind how a request's share
of it moves (its registered ``RequestKV``, ``kvjax.pools.registry.request_kv_of``): there is no
branch per kind here. ``KVTransferServer`` wraps ``jax.experimental.transfer``: a process of the
prefill side offers arrays under a transfer id (``await_pull``), a process of the decode side
pulls them into its own devices (``connect(address).pull``), every pull bounded by a deadline.
Each process of a side runs a transfer server of its own.

How the pieces are cut on the way (``piece_units``): a piece's heads travel in units that lie
within one device block on either side, each offered by the one sending process that holds it
(:func:`offer_units`) and pulled by every receiving process that holds it
(:func:`pull_units`), so the two sides may differ in tensor-parallel size and in number of
processes; both sides plan the same units from the layouts and specs exchanged (no message per
unit). On the decode side the pulled units make global arrays, laid onto the pool's own sharding
(a device-to-device copy) and written in place (``RequestKV.scatter``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import SingleDeviceSharding

from kvjax.disaggregation.messages import PieceMessage
from kvjax.disaggregation.piece_units import PieceUnits
from kvjax.plan.draft import DRAFT_POOL_NAME
from kvjax.pools.registry import request_kv_of
from kvjax.transfers.request_kv import PieceSpec, RequestSpan

__all__ = [
    "CacheMovers",
    "KVTransferServer",
    "TransferTimeout",
    "TRANSFER_ID_STRIDE",
    "TransferUnreachable",
    "offer_units",
    "piece_message",
    "pull_units",
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


def piece_message(pool: str, spec: PieceSpec, units: int) -> PieceMessage:
    return PieceMessage(
        pool,
        spec.name,
        tuple(int(s) for s in spec.shape),
        spec.dtype,
        -1 if spec.head_axis is None else spec.head_axis,
        units,
    )


#: Transfer ids of one offer: ``base + receiving process`` (a base is fresh per offer, a multiple of this).
TRANSFER_ID_STRIDE = 1 << 8


def offer_units(
    transfer: KVTransferServer,
    transfer_id: int,
    plan: PieceUnits,
    arrays: Sequence[jax.Array],
    devices: Sequence[Any],
    process: int,
) -> None:
    """Offer the units of ``arrays`` (``plan.specs``' pieces, global arrays over the sending
    side's ``devices``) that sending process ``process`` owns: to each receiving process the ones
    it needs (``PieceUnits.offered``), under ``transfer_id + receiving process``. Every sending
    process calls it with the same arguments (the pieces are laid onto the side's layout
    sharding, a collective); the transfer server counts the bytes (``bytes_offered``)."""
    laid = [jax.device_put(a, plan.sender.sharding(devices, spec)) for a, spec in zip(arrays, plan.specs, strict=True)]
    shards = [{s.device.id: s.data for s in a.addressable_shards} for a in laid]
    for receiver in plan.receiver.process_ids:
        wanted = plan.offered(process, receiver)
        if not wanted:
            continue
        units = []
        for piece, unit in wanted:
            block = shards[piece][devices[plan.owner_position(piece, unit)].id]
            axis = plan.specs[piece].head_axis
            lo, hi = plan.unit_range(piece, unit, plan.sender)
            units.append(
                block if axis is None or hi - lo == block.shape[axis] else lax.slice_in_dim(block, lo, hi, axis=axis)
            )
        transfer.offer(transfer_id + receiver, units)


def pull_units(
    transfer: KVTransferServer,
    transfer_id: int,
    plan: PieceUnits,
    addresses: Sequence[str],
    devices: Sequence[Any],
    process: int,
    deadline: float,
) -> list[jax.Array]:
    """Pull what receiving process ``process`` needs of offer ``transfer_id`` from every sending
    process (``addresses``: each one's transfer server, by process id), each unit onto the first
    of this process's devices holding its block, and make each piece a global array over the
    receiving side's ``devices`` in its layout sharding (``SideLayout.sharding``). Every
    receiving process calls it; ``TransferTimeout`` / ``TransferUnreachable`` as ``pull``."""
    local = [i for i, d in enumerate(devices) if d.process_index == process]
    target: dict[tuple[int, int], Any] = {}
    for piece, spec in enumerate(plan.specs):
        for unit in range(plan.units(piece)):
            held = plan.receiver.block_devices(spec, plan.receiver_block(piece, unit))
            mine = [i for i in held if i in local]
            if mine:
                target[(piece, unit)] = devices[mine[0]]
    pulled: dict[tuple[int, int], jax.Array] = {}
    for sender in plan.sender.process_ids:
        wanted = plan.offered(sender, process)
        if not wanted:
            continue
        structs = [
            jax.ShapeDtypeStruct(
                plan.unit_shape(piece),
                jnp.dtype(plan.specs[piece].dtype),
                sharding=SingleDeviceSharding(target[(piece, unit)]),
            )
            for piece, unit in wanted
        ]
        arrays = transfer.pull(addresses[sender], transfer_id + process, structs, max(deadline - time.monotonic(), 0.1))
        pulled.update(zip(wanted, arrays, strict=True))
    out: list[jax.Array] = []
    for piece, spec in enumerate(plan.specs):
        per_block = plan.units(piece) // plan.receiver.blocks(spec)
        blocks: dict[int, jax.Array] = {}
        per_device = []
        for position in local:
            block = position // (plan.receiver.devices // plan.receiver.blocks(spec))
            if block not in blocks:
                parts = [pulled[(piece, u)] for u in range(block * per_block, (block + 1) * per_block)]
                axis = spec.head_axis
                blocks[block] = parts[0] if len(parts) == 1 or axis is None else jnp.concatenate(parts, axis=axis)
            per_device.append(jax.device_put(blocks[block], devices[position]))
        sharding = plan.receiver.sharding(devices, spec)
        out.append(jax.make_array_from_single_device_arrays(tuple(spec.shape), sharding, per_device))
    return out


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
