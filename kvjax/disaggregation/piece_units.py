"""How a request's pieces are cut on the way between two sides of any shape: `SideLayout` and
`PieceUnits`.

A side (a prefill or a decode server) is one process or a group of processes (``jax.distributed``)
whose pools lie on one mesh. What the other side needs to know of it is its `SideLayout`: the
process of each of the pools' devices, in the mesh's order (the handshake carries it both ways).

A piece with a head axis (``PieceSpec.head_axis``: MHA rows) travels in **units**: its heads cut
into ``units`` equal groups, ``units = lcm(blocks on one side, blocks on the other)``, where a
side's *blocks* are ``gcd(devices, heads)``: the side lays the piece over its devices as a mesh of
``(blocks, devices / blocks)``, heads split over the first axis (:meth:`SideLayout.sharding`).
Both sides' blocks divide the heads, so their lcm does: a unit lies inside one block on either
side, so every unit is offered by exactly one process of the sending side (its **owner**: the
process of its block's first device) and pulled by each process of the receiving side whose
devices hold a block it falls in. A piece without a head axis (per-token rows replicated over
the heads, scales, recurrent state) is one unit, owned by the first device's process.

Every process of both sides computes the same plan from the two layouts and the pieces' specs
(pure functions of them, no message per unit): :meth:`PieceUnits.offered` lists what one sending
process offers one receiving process, in the order that process pulls it. One side of one
process and a tp of 1 give one unit per piece on the first device: the plan of a colocated pair.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.transfers.request_kv import PieceSpec

__all__ = ["PieceUnits", "SideLayout", "pool_devices"]

#: The layout mesh's axes: head blocks, and the devices holding a copy of each block.
BLOCK_AXIS, COPY_AXIS = "blocks", "copies"


def pool_devices(cache: Any) -> list[Any]:
    """The devices ``cache``'s pools lie on, in their mesh's order (this process's first device
    for a cache without a mesh). ``ValueError`` when its device pools lie on different meshes."""
    held = (getattr(cache.pools[name], "mesh", None) for name in cache.pools.names)
    meshes = {id(m): m for m in held if m is not None}
    if not meshes:
        return [jax.local_devices()[0]]
    devices = {tuple(d.id for d in m.devices.flat): list(m.devices.flat) for m in meshes.values()}
    if len(devices) > 1:
        raise ValueError(f"the cache's pools lie on {len(devices)} different sets of devices; one set moves")
    return next(iter(devices.values()))


@dataclass(frozen=True)
class SideLayout:
    """The process of each device a side's pools lie on, in the mesh's order."""

    processes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.processes:
            raise ValueError("a side's layout needs at least one device")

    @classmethod
    def of(cls, devices: Sequence[Any]) -> SideLayout:
        return cls(tuple(int(d.process_index) for d in devices))

    @property
    def devices(self) -> int:
        return len(self.processes)

    @property
    def process_ids(self) -> tuple[int, ...]:
        """The side's processes, each once, ascending."""
        return tuple(sorted(set(self.processes)))

    def blocks(self, spec: PieceSpec) -> int:
        """Head blocks of ``spec`` on this side (1 without a head axis)."""
        if spec.head_axis is None:
            return 1
        return math.gcd(self.devices, int(spec.shape[spec.head_axis]))

    def block_devices(self, spec: PieceSpec, block: int) -> range:
        """Positions (in the layout) of the devices holding head block ``block`` of ``spec``."""
        per = self.devices // self.blocks(spec)
        return range(block * per, (block + 1) * per)

    def sharding(self, devices: Sequence[Any], spec: PieceSpec) -> NamedSharding:
        """Where ``spec`` lies on this side while it moves (``devices``: the layout's, in order):
        heads split over ``blocks`` groups of devices, each group holding its block whole."""
        blocks = self.blocks(spec)
        mesh = Mesh(np.asarray(devices, dtype=object).reshape(blocks, -1), (BLOCK_AXIS, COPY_AXIS))
        parts: list[str | None] = [None] * len(spec.shape)
        if spec.head_axis is not None:
            parts[spec.head_axis] = BLOCK_AXIS
        return NamedSharding(mesh, P(*parts))


@dataclass(frozen=True)
class PieceUnits:
    """The unit plan of moving ``specs`` from the ``sender`` layout to the ``receiver`` one."""

    specs: tuple[PieceSpec, ...]
    sender: SideLayout
    receiver: SideLayout

    def units(self, piece: int) -> int:
        """Units piece ``piece`` travels in (the lcm of both sides' head blocks)."""
        spec = self.specs[piece]
        return math.lcm(self.sender.blocks(spec), self.receiver.blocks(spec))

    def unit_heads(self, piece: int) -> int:
        """Heads in one unit of piece ``piece`` (its whole head axis for one unit)."""
        spec = self.specs[piece]
        heads = 1 if spec.head_axis is None else int(spec.shape[spec.head_axis])
        return heads // self.units(piece)

    def unit_shape(self, piece: int) -> tuple[int, ...]:
        spec = self.specs[piece]
        shape = list(spec.shape)
        if spec.head_axis is not None:
            shape[spec.head_axis] = self.unit_heads(piece)
        return tuple(shape)

    def _block(self, layout: SideLayout, piece: int, unit: int) -> int:
        return unit * layout.blocks(self.specs[piece]) // self.units(piece)

    def owner_position(self, piece: int, unit: int) -> int:
        """The sender's layout position (device) that offers unit ``unit`` of piece ``piece``: the
        first device of the block holding it."""
        return self.sender.block_devices(self.specs[piece], self._block(self.sender, piece, unit))[0]

    def owner(self, piece: int, unit: int) -> int:
        """The sending process that offers unit ``unit`` of piece ``piece``."""
        return self.sender.processes[self.owner_position(piece, unit)]

    def receiver_block(self, piece: int, unit: int) -> int:
        return self._block(self.receiver, piece, unit)

    def needed_by(self, piece: int, unit: int) -> frozenset[int]:
        """The receiving processes whose devices hold unit ``unit`` of piece ``piece``."""
        positions = self.receiver.block_devices(self.specs[piece], self.receiver_block(piece, unit))
        return frozenset(self.receiver.processes[i] for i in positions)

    def offered(self, sender: int, receiver: int) -> list[tuple[int, int]]:
        """``(piece, unit)`` that sending process ``sender`` offers receiving process ``receiver``,
        in the order of the offer (pieces in order, units ascending)."""
        return [
            (piece, unit)
            for piece in range(len(self.specs))
            for unit in range(self.units(piece))
            if self.owner(piece, unit) == sender and receiver in self.needed_by(piece, unit)
        ]

    def unit_range(self, piece: int, unit: int, layout: SideLayout) -> tuple[int, int]:
        """Heads ``[lo, hi)`` of unit ``unit`` within its block of ``layout`` (the offset into
        that side's block array)."""
        spec = self.specs[piece]
        per_block = self.units(piece) // layout.blocks(spec)
        lo = (unit % per_block) * self.unit_heads(piece)
        return lo, lo + self.unit_heads(piece)
