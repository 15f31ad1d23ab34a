"""`HeadShards`: each device's block of a sharded pool's head axis, placed in the host page."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.tiers.head_shards import HeadShards
from kvjax.tiers.host_pool import HostKVPool

SHAPE = (5, 4, 8, 16)  # pages + 1, page_size, 2 * pool heads (K and V adjacent), head dim


class _Split:
    """A sharding that splits the head axis into ``blocks`` over devices ``0 .. blocks-1``."""

    def __init__(self, blocks: int, axis: int = 2) -> None:
        self.blocks, self.axis = blocks, axis

    def devices_indices_map(self, shape):
        width = shape[self.axis] // self.blocks
        out = {}
        for d in range(self.blocks):
            index = [slice(None)] * len(shape)
            index[self.axis] = slice(d * width, (d + 1) * width)
            out[d] = tuple(index)
        return out


def test_heads_split_over_ranks_map_to_the_same_heads_on_the_host():
    shards = HeadShards.of(_Split(4), SHAPE, host_heads=8, replicas=1)
    assert [(c.device_heads, c.host_heads) for c in shards.copies] == [(slice(2 * d, 2 * d + 2),) * 2 for d in range(4)]
    assert len(shards.sources) == 4


def test_replicated_heads_are_kept_once_and_read_from_the_first_rank_of_each_group():
    # 4 ranks, 2 model KV heads: ranks 0, 1 hold head 0 and ranks 2, 3 head 1.
    shards = HeadShards.of(_Split(4), SHAPE, host_heads=4, replicas=2)
    assert [c.host_heads for c in shards.copies] == [slice(0, 2), slice(0, 2), slice(2, 4), slice(2, 4)]
    assert [c.device for c in shards.sources] == [0, 2]


def test_a_pool_replicated_on_every_device_is_one_copy():
    class Whole:
        def devices_indices_map(self, shape):
            return {d: tuple(slice(None) for _ in shape) for d in range(3)}

    shards = HeadShards.of(Whole(), (5, 4, 32), host_heads=None)
    assert len(shards.sources) == 1 and shards.sources[0].device == 0


class _Grid:
    """A sharding that splits the row axis into ``ranks`` (DCP) and the head axis into ``blocks``
    (TP): device ``r * blocks + b`` holds rows block ``r`` and head block ``b``."""

    def __init__(self, ranks: int, blocks: int) -> None:
        self.ranks, self.blocks = ranks, blocks

    def devices_indices_map(self, shape):
        rows, heads = shape[1] // self.ranks, shape[2] // self.blocks
        out = {}
        for r in range(self.ranks):
            for b in range(self.blocks):
                index = [slice(None)] * len(shape)
                index[1], index[2] = slice(r * rows, (r + 1) * rows), slice(b * heads, (b + 1) * heads)
                out[r * self.blocks + b] = tuple(index)
        return out


def test_rows_striped_over_dcp_ranks_map_to_the_same_rows_of_the_host_page():
    shards = HeadShards.of(_Grid(2, 2), SHAPE, host_heads=8, replicas=1)
    assert [(c.rows, c.host_heads) for c in shards.copies] == [
        (slice(0, 2), slice(0, 4)),
        (slice(0, 2), slice(4, 8)),
        (slice(2, 4), slice(0, 4)),
        (slice(2, 4), slice(4, 8)),
    ]
    assert len(shards.sources) == 4 and shards.replicas == 1
    # A latent row (no head axis) replicated over 2 TP ranks per DCP rank: one source per rank's rows.
    latent = HeadShards.of(_Grid(2, 1), (5, 4, 32), host_heads=None)
    assert [c.rows for c in latent.sources] == [slice(0, 2), slice(2, 4)]


def test_layouts_the_host_tier_cannot_copy_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="split over axis 0"):
        HeadShards.of(_Split(5, axis=0), SHAPE, host_heads=8)
    with pytest.raises(ValueError, match="every distinct head once"):
        HeadShards.of(_Split(4), SHAPE, host_heads=8, replicas=2)


def test_a_host_pool_writes_one_shards_heads_only():
    pool = HostKVPool(8, 2, (4, 8, 16), 2, "layer_first")
    slots = pool.allocator.alloc(4)
    shard = np.full((2, 1, 4, 2, 16), 7, np.uint16)
    pool.write_pages(slots, shard, heads=slice(2, 4))
    page = pool.read_pages(slots)
    assert (page[:, :, :, 2:4] == 7).all() and (page[:, :, :, :2] == 0).all() and (page[:, :, :, 4:] == 0).all()
    with pytest.raises(ValueError, match="want"):
        pool.write_pages(slots, shard, heads=slice(0, 4))


def test_a_host_pool_writes_one_dcp_ranks_rows_only():
    pool = HostKVPool(8, 2, (4, 8, 16), 2, "page_first")
    slots = pool.allocator.alloc(4)
    rank_1 = np.full((2, 1, 2, 2, 16), 5, np.uint16)  # rows 2..3 (rank 1 of 2), heads 2..3
    pool.write_pages(slots, rank_1, heads=slice(2, 4), rows=slice(2, 4))
    page = pool.read_pages(slots)
    assert (page[:, :, 2:, 2:4] == 5).all()
    assert (page[:, :, :2] == 0).all() and (page[:, :, :, :2] == 0).all() and (page[:, :, :, 4:] == 0).all()
    with pytest.raises(ValueError, match="want"):
        pool.write_pages(slots, rank_1, heads=slice(2, 4), rows=slice(0, 4))


class _Device:
    """A device of process ``process_index`` (what ``HeadShards.on_process`` reads)."""

    def __init__(self, index: int, process_index: int) -> None:
        self.index, self.process_index = index, process_index

    def __repr__(self) -> str:
        return f"d{self.index}@p{self.process_index}"


class _SplitOverProcesses(_Split):
    """``_Split`` whose devices belong to ``processes`` processes, in order (as a pod's mesh)."""

    def __init__(self, blocks: int, processes: int) -> None:
        super().__init__(blocks)
        per = blocks // processes
        self.devices = [_Device(d, d // per) for d in range(blocks)]

    def devices_indices_map(self, shape):
        return {self.devices[d]: index for d, index in super().devices_indices_map(shape).items()}


def test_each_process_backs_up_the_host_blocks_its_own_devices_hold():
    # tp 8 over 2 processes x 4 devices, 2 model KV heads: each head on 4 ranks, one process's.
    shards = HeadShards.of(_SplitOverProcesses(8, 2), (5, 4, 16, 16), host_heads=4, replicas=4)
    assert [c.device.index for c in shards.sources] == [0, 4]
    for process, first in ((0, 0), (1, 4)):
        local = shards.on_process(process)
        assert all(c.device.process_index == process for c in local.copies) and len(local.copies) == 4
        assert [c.device.index for c in local.sources] == [first]  # its head, read once
        assert local.host_blocks == ((slice(None), slice(2 * process, 2 * process + 2)),)
    # heads split finer than the processes: each process holds two of the four host blocks
    finer = HeadShards.of(_SplitOverProcesses(4, 2), SHAPE, host_heads=8, replicas=1)
    assert [h for _, h in finer.on_process(1).host_blocks] == [slice(4, 6), slice(6, 8)]
    assert finer.on_process(2).copies == ()  # a process holding none of the pool
