"""Shared fixtures for the radix tests: a recording allocator, small request harnesses and the
settings of the stateful model-based tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, settings

from kvjax.alloc import make_allocator
from kvjax.radix import RadixCache
from kvjax.req_pool import ReqToTokenPool
from kvjax.request import Req


def machine_settings(examples: int) -> settings:
    """Hypothesis settings of a stateful model-based tree test: ``examples`` runs of as many
    steps each, no deadline, slow and heavily filtered runs allowed, and no "explain" phase
    (tracing a failing stateful run can take minutes)."""
    return settings(
        max_examples=examples,
        stateful_step_count=examples,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


class RecordingAllocator:
    """Forwards to a real allocator of ``size`` slots and ``page_size`` and records each
    non-empty ``free`` / ``free_segment`` / ``free_from_tree`` call's ids (``freed``: one list
    per call)."""

    def __init__(self, size: int, page_size: int) -> None:
        self.inner = make_allocator(size, page_size)
        self.freed: list[list[int]] = []

    def free(self, idx) -> None:
        ids = np.asarray(idx).reshape(-1).tolist()
        self.inner.free(idx)
        if ids:
            self.freed.append(ids)

    def free_segment(self, idx, *, start_pos: int) -> None:
        ids = np.asarray(idx).reshape(-1).tolist()
        self.inner.free_segment(idx, start_pos=start_pos)
        if ids:
            self.freed.append(ids)

    def free_from_tree(self, idx, *, segment: bool = True) -> None:
        """The tree's own frees of the slots it holds (recorded as a ``free`` / ``free_segment``)."""
        ids = np.asarray(idx).reshape(-1).tolist()
        self.inner.free_from_tree(idx, segment=segment)
        if ids:
            self.freed.append(ids)

    def take(self) -> list[int]:
        """Every id freed since the last take, in order, flattened."""
        return [i for call in self.take_calls() for i in call]

    def take_calls(self) -> list[list[int]]:
        """The ids of each non-empty free call since the last take, call by call, in order."""
        out, self.freed = self.freed, []
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Harness:
    """A tree with real pools plus helpers to run requests through it."""

    def __init__(self, page_size: int = 1, size: int = 64, rows: int = 4, width: int = 64, **tree_kwargs) -> None:
        self.ps = page_size
        self.alloc = RecordingAllocator(size, page_size)
        self.pool = ReqToTokenPool(rows, width)
        self.tree = RadixCache(
            page_size=page_size,
            token_to_kv_pool_allocator=self.alloc,
            req_to_token_pool=self.pool,
            **tree_kwargs,
        )
        self.capacity = self.alloc.available_size()
        self.held: dict[int, int] = {}

    def new_row(self) -> int:
        """A free row of the request pool."""
        rows = self.pool.alloc(1)
        assert rows is not None, "test request pool too small"
        return rows[0]

    def free_row(self, req: Req) -> None:
        assert req.req_pool_idx is not None
        self.pool.free(req.req_pool_idx)

    @staticmethod
    def row_of(req: Req) -> int:
        assert req.req_pool_idx is not None, f"request {req.rid!r} has no row"
        return req.req_pool_idx

    def start(self, prompt, extra_key=None, priority=0) -> Req:
        """Match + lock the prompt, take a row, give the rest of the prompt fresh slots."""
        tree = self.tree
        row = self.new_row()
        req = Req(
            rid=f"r{row}", origin_input_ids=list(prompt), extra_key=extra_key, priority=priority, req_pool_idx=row
        )
        m = tree.match_and_lock(req)
        self.pool.write(row, 0, m.indices)
        self.extend(req, len(prompt) - m.prefix_len, start=m.prefix_len)
        return req

    def extend(self, req: Req, n: int, start: int | None = None) -> np.ndarray:
        """Give ``n`` more tokens of ``req`` KV slots (continuing its last partial page)."""
        ps = self.ps
        pos = req.kv_len() - n if start is None else start
        row = self.pool.req_to_token[req.req_pool_idx]
        room = (-pos) % ps
        first = [int(row[pos - 1]) + 1 + i for i in range(min(room, n))] if room else []
        need = n - len(first)
        fresh = self.alloc.alloc(-(-need // ps) * ps) if need > 0 else np.zeros(0, np.int32)
        assert fresh is not None, "test pool too small"
        slots = np.concatenate([np.asarray(first, np.int32), np.asarray(fresh, np.int32)[:need]])
        self.pool.write(self.row_of(req), pos, slots)
        return slots

    def decode(self, req: Req, tokens) -> np.ndarray:
        """Append generated tokens (with KV) to ``req``."""
        req.output_ids.extend(tokens)
        return self.extend(req, len(tokens))

    def row(self, req: Req) -> list[int]:
        return self.pool.req_to_token[req.req_pool_idx, : req.kv_len()].tolist()

    def finish(self, req: Req) -> list[int]:
        """``cache_finished_req`` then free the row; returns the ids the tree freed."""
        self.alloc.take()
        self.tree.cache_finished_req(req)
        self.free_row(req)
        return self.alloc.take()

    def check(self) -> None:
        """Tree invariants, and no slot lost or double-owned given the live requests."""
        t = self.tree
        t.sanity_check()
        assert t.evictable_size() + t.protected_size() == t.total_size()


class WindowHarness:
    """A request table, an allocator and a sliding-window tree (``SWARadixCache`` or
    ``PureSWARadixCache``); requests get fresh slots for their tokens. Subclasses say how decode
    frees the slots that leave the window (``leave_window``)."""

    def __init__(self, tree_cls: type, alloc: Any, window: int, page_size: int) -> None:
        self.alloc = alloc
        self.pool = ReqToTokenPool(4, 64)
        self.tree = tree_cls(
            page_size=page_size, sliding_window_size=window, allocator=self.alloc, req_to_token_pool=self.pool
        )

    def start(self, tokens: list[int]) -> Req:
        """Match + lock ``tokens``, take a row, give the rest fresh slots; the tree's prefix
        counts as already out of the request's own window."""
        rows = self.pool.alloc(1)
        assert rows is not None
        req = Req(f"r{rows[0]}", list(tokens), req_pool_idx=rows[0])
        m = self.tree.match_and_lock(req)
        self.pool.write(rows[0], 0, m.indices)
        fresh = self.alloc.alloc(len(tokens) - m.prefix_len)
        assert fresh is not None
        self.pool.write(rows[0], m.prefix_len, fresh)
        req.swa_evicted_seqlen = req.cache_protected_len
        return req

    def finish(self, req: Req, insert: bool = True) -> None:
        self.tree.cache_finished_req(req, insert)
        assert req.req_pool_idx is not None
        self.pool.free(req.req_pool_idx)


def sizes(tree) -> tuple[int, int, int]:
    return tree.evictable_size(), tree.protected_size(), tree.total_size()
