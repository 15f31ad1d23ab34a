"""`HeadShards`: which KV heads (and striped rows) of a host page each device's shard of a pool holds.

A device pool sharded over tensor-parallel ranks keeps per-layer page arrays
``[pages + 1, page_size, C, D]`` whose combined K/V head axis ``C`` (K and V of a head adjacent,
``kvjax.pools.mha``) is split over the mesh's KV-head axis: each device holds a contiguous block of
whole heads, every page of it. The host tier moves pages shard by shard, so each device's block
must be placed in the host page.

Host layout (why one numpy array with the head axis): the host pool's page row is
``(page_size, C_host, D)``, every *distinct* head once, in the device pool's head order. One
array keeps one host slot id space, one allocator and one ``read_pages``/``write_pages`` for the
tree, the storage tier and the retraction backup (as on one device); a backup writes each shard
into its head slice of the host page and a load reads each device's slice out of it, with no
gather of the pool (or of the moved pages) onto one device. A host array per rank would need one
allocator per rank kept in lock step, for nothing.

Replicated heads: when the TP size exceeds the model's KV heads, each rank holds one head and
``replicas = C_device / C_host`` adjacent ranks hold copies of the same head (``expand_kv_heads``).
The host page keeps that head **once**: device block ``b`` maps to host block ``b // replicas``; a
backup reads the first rank of each group (:attr:`HeadShards.sources`) and a load writes the host
block into every rank of its group. A pool whose arrays are replicated over every device (MLA's
latent under TP) is one block: the host keeps one copy, read from the first device.

Striped rows (decode context parallelism, ``kvjax.alloc.dcp``): a pool striped over ``dcp``
ranks has global page arrays ``[pages + 1, page_size * dcp, ...]`` whose row axis
(:data:`ROW_AXIS`) is split over the ``"dcp"`` mesh axis, rank-major: DCP rank ``r`` holds rows
``r * page_size .. (r + 1) * page_size - 1`` of every page, its local rows. A striped page is the
tree's (and the host allocator's) page of ``page_size * dcp`` slots, and the host page keeps the
global page's rows in the same rank-major order, every striped row once: slot offset ``o`` of a
tree page (logical token ``o`` of the page) lives on rank ``o % dcp`` at local row ``o // dcp``,
i.e. row ``(o % dcp) * page_size + o // dcp`` of the device page and of the host page
(``DCPStripe.page_row``). A device's rows are therefore the same slice of the host page
(:attr:`ShardCopy.rows`): a backup writes them there and a load reads them back, per device,
with no reordering and no collective.

Invariants: only the row axis and the head axis may be split (pages and head dim whole on every
device); blocks are of equal width; the number of head blocks is a multiple of ``replicas``.
Anything else raises ``NotImplementedError`` naming the layout, before any copy starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["HEAD_AXIS", "ROW_AXIS", "HeadShards", "ShardCopy"]

#: The token-row axis of a page array: split over the DCP ranks when the pool is striped.
ROW_AXIS = 1
#: The combined K/V head axis of a ``[pages + 1, page_size, C, D]`` page array.
HEAD_AXIS = 2


@dataclasses.dataclass(frozen=True)
class ShardCopy:
    """One device's shard: ``device_heads`` of the device array's head axis, held in the host
    page's ``host_heads`` (both ``slice(None)`` for an array without a split head axis), and the
    page ``rows`` it holds, the same rows of the host page (``slice(None)``: every row; a DCP
    rank's ``rank * page_size .. (rank + 1) * page_size`` of a striped pool)."""

    device: Any
    device_heads: slice
    host_heads: slice
    rows: slice = dataclasses.field(default_factory=lambda: slice(None))


def _span(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise NotImplementedError(f"a device shard with stride {step} on the KV-head axis")
    return start, stop


@dataclasses.dataclass(frozen=True)
class HeadShards:
    """Per-device shards of one device pool's page arrays and their place in the host page.

    ``copies``: every device of the pool, in the sharding's device order. ``sources``: one device
    per distinct host block (rows and heads; the first that holds it): what a backup reads.
    ``replicas``: devices holding each host block (1 when nothing is replicated).
    """

    copies: tuple[ShardCopy, ...]
    replicas: int

    @property
    def sources(self) -> tuple[ShardCopy, ...]:
        seen: set[tuple[Any, ...]] = set()
        out = []
        for copy in self.copies:
            key = (copy.rows.start, copy.rows.stop, copy.host_heads.start, copy.host_heads.stop)
            if key not in seen:
                seen.add(key)
                out.append(copy)
        return tuple(out)

    def on_process(self, process_index: int) -> HeadShards:
        """The copies whose devices belong to process ``process_index`` (``device.process_index``),
        with the same host placement: what that process can back up and load. Across processes
        (``jax.distributed``) a process addresses only its own devices' shards, so each keeps (and
        stores) only the host blocks they hold; every block of a one-process mesh is local. Empty
        when the process holds none of the pool."""
        return HeadShards(tuple(c for c in self.copies if c.device.process_index == process_index), self.replicas)

    @property
    def host_blocks(self) -> tuple[tuple[slice, slice], ...]:
        """The distinct ``(rows, host_heads)`` blocks of the host page these copies hold, in
        :attr:`sources` order."""
        return tuple((c.rows, c.host_heads) for c in self.sources)

    @classmethod
    def of(cls, sharding: Any, shape: tuple[int, ...], host_heads: int | None, replicas: int = 1) -> HeadShards:
        """The shards of a page array of global ``shape`` laid out by ``sharding`` (a
        ``jax.sharding.Sharding``), for a host page of ``host_heads`` heads on the head axis
        (None: the array has no head axis, e.g. MLA's ``[pages + 1, page_size, row]``), where
        ``replicas`` adjacent head blocks hold copies of one host block (the plan's
        ``kv_head_replicas`` when the head axis is split; ignored otherwise). The row axis may be
        split (a pool striped over DCP ranks): each device's rows are the same rows of the host
        page, whose row count is the global array's.

        Raises NotImplementedError for a layout the host tier cannot copy (module docstring),
        ValueError when the host page's heads are not the device's over ``replicas``."""
        indices = sharding.devices_indices_map(tuple(shape))
        split = HEAD_AXIS if host_heads is not None else None
        spans: dict[Any, tuple[int, int]] = {}
        row_spans: dict[Any, tuple[int, int]] = {}
        for device, index in indices.items():
            for axis, (part, size) in enumerate(zip(index, shape, strict=True)):
                if axis not in (split, ROW_AXIS) and _span(part, size) != (0, size):
                    raise NotImplementedError(
                        f"a device pool split over axis {axis} of its page arrays {tuple(shape)}: the host tier "
                        "copies pools split over the KV-head axis and the striped row axis only"
                    )
            row_spans[device] = _span(index[ROW_AXIS], shape[ROW_AXIS])
            spans[device] = _span(index[split], shape[split]) if split is not None else (0, 0)
        row_widths = {stop - start for start, stop in row_spans.values()}
        if len(row_widths) != 1:
            raise NotImplementedError(f"device row blocks {sorted(set(row_spans.values()))} of unequal widths")
        rows = {d: slice(None) if span == (0, shape[ROW_AXIS]) else slice(*span) for d, span in row_spans.items()}
        if split is None or host_heads is None:
            whole = slice(None)
            return cls._grouped(tuple(ShardCopy(d, whole, whole, rows[d]) for d in indices))
        blocks = sorted(set(spans.values()))
        widths = {stop - start for start, stop in blocks}
        device_heads = shape[split]
        if len(widths) != 1 or device_heads % host_heads:
            raise NotImplementedError(
                f"device head blocks {blocks} of {device_heads} heads for a host page of {host_heads}: the host "
                "tier needs equal blocks and a host head count dividing the device's"
            )
        if len(blocks) == 1:  # the head axis is whole on every device (replicated pool)
            if host_heads != device_heads:
                raise ValueError(f"a pool of {device_heads} heads on every device for a host page of {host_heads}")
            whole = slice(0, device_heads)
            return cls._grouped(tuple(ShardCopy(d, whole, whole, rows[d]) for d in indices))
        if replicas < 1 or host_heads * replicas != device_heads:
            raise ValueError(
                f"a host page of {host_heads} heads for a device pool of {device_heads} heads with {replicas} "
                "replicas of each: the host page holds every distinct head once (device heads / replicas)"
            )
        if len(blocks) % replicas:
            raise NotImplementedError(f"{len(blocks)} head blocks do not group into replicas of {replicas}")
        (width,) = widths
        block_of = {span: i for i, span in enumerate(blocks)}
        copies = []
        for device, (start, stop) in spans.items():
            host_block = block_of[(start, stop)] // replicas
            host = slice(host_block * width, (host_block + 1) * width)
            copies.append(ShardCopy(device, slice(start, stop), host, rows[device]))
        return cls._grouped(tuple(copies))

    @classmethod
    def _grouped(cls, copies: tuple[ShardCopy, ...]) -> HeadShards:
        """``copies`` with ``replicas``: devices per distinct host block (rows and heads)."""
        shards = cls(copies, 1)
        return cls(copies, len(copies) // len(shards.sources))
