"""kvjax's allocators and prefix trees next to SGLang 0.5.23's, op by op, on random streams.

    python benchmarks/compare_sglang_trees.py --sglang-path DIR [--streams N] [--ops 2000] [--quick]
        [--only KIND[,KIND...]] [--seed S] [--self-test]

``--sglang-path`` is the folder that holds the ``sglang`` package (an unpacked wheel or an SGLang
checkout's ``python/`` folder). Only SGLang's allocator and tree modules run for real; every other
SGLang module they import is an inert placeholder (``compare_peers._PeerImporter``), and the few
third-party packages those real modules import at the top without using them here (``pybase64``,
``triton``, ``starlette``) are placeholders too when they are not installed. SGLang's tree is its
``UnifiedRadixCache`` on the Python tree core, with the components FULL, FULL + SWA or FULL + MAMBA,
over its real token / paged / SWA allocators and its real Mamba slot allocator; it needs ``torch``
(CPU is enough) and ``msgspec``.

Kinds (``--only``), each over several configurations:

* ``alloc``: the token (page 1) and paged (pages 4, 16) allocators, ``need_sort`` off and on:
  alloc, alloc_extend and alloc_decode for batches of live rows, frees of whole rows and of row
  tails by ``free_segment`` (SGLang's tree frees) and by ``free`` (sorted per page), free groups.
  At page 1 SGLang's scheduler takes ``alloc(extend_tokens)`` / ``alloc(batch)`` from the token
  allocator where kvjax calls ``alloc_extend`` / ``alloc_decode``; that is what is compared.
* ``full``: FULL trees at pages 1, 4, 16 over the real allocators, two namespaces (``extra_key``);
  then once per eviction policy both have (lru, lfu, fifo, mru, filo, priority, slru; SGLang's
  tlru is not in kvjax), each request inserting with a priority of 0 to 2.
* ``lifecycle``: the request lifecycle (admission: match, lock, ``alloc_extend``, a chunked
  checkpoint and one of the whole prompt; decode checkpoints one ``alloc_extend`` token at a
  time; finishes, retractions, evictions, and the scheduler's eviction under allocation pressure
  through the allocator's ``evict_to_free_tokens``) of SGLang 0.5.23's ``RadixCache`` driven as
  its ``mem_cache/common.py`` drives it (``checkpoint`` / ``release_kv_cache``), and of its
  ``UnifiedRadixCache`` (FULL), over its real token / paged allocator, next to kvjax's
  ``RadixCache`` lifecycle (``match_and_lock``, ``cache_unfinished_req``,
  ``cache_finished_req``) over kvjax's allocator: every eviction policy, pages 1, 4, 16,
  requests with priorities -1 to 2 in two namespaces. Compared after every op: the slots handed
  out (in order), matches, evicted counts, free slots, evictable and protected sizes; at the
  end the trees (boundaries, slots, priorities, hit counts) and the whole free list's order.
* ``swa``: FULL + SWA trees, pages 1, 2, 4, windows 4 to 8, early SWA lock release.
* ``mamba``: FULL + MAMBA trees, pages 1 and 4 (page 4 with the extra buffer), with no cap and
  ``mamba_max_states_per_path`` 1 and 2.
* ``hicache``: the FULL tree with a host tier (kvjax's ``HiRadixCache``), write policies
  ``write_through``, ``write_through_selective``, ``write_back``, host ratios 0.5 and 2, pages 1
  (64 device tokens) and 4 (32 device pages). SGLang's side is its ``UnifiedRadixCache`` with
  what ``init_hicache`` attaches replaced by CPU-only, synchronous stand-ins that move slot ids
  only: a host pool with ``HostKVCache``'s free list, a one-pool ``HostPoolGroup``, and a
  controller whose ``write`` / ``load`` take host / device slots and queue the transfer, and
  whose ``start_writing`` / ``start_loading`` (the scheduler's flush) turn the queue into an ack
  that has already finished, so the next ``writing_check`` / ``loading_check`` completes it, as
  SGLang's polling does. Ops: admissions that load a host hit back (``init_load_back``),
  finishes, retractions, chunked checkpoints, matches, held locks, device evictions (write_back
  backs up synchronously), host evictions and the polling step (flush, ``writing_check``,
  ``loading_check``); the host slots each op allocated and freed (in order) are compared too,
  and the host pool's free size.

Tree streams interleave request admissions (match, lock, allocate the rest, evicting under
pressure when the allocator runs short), chunked checkpoints (insert the first pages, move the lock
to the node the insert ended on, protecting the whole inserted path: 0.5.23's
``checkpoint_into_tree``; FULL and SWA), finishes (insert with
``prev_prefix_len``, unlock), retractions (free the request's new slots, unlock), plain matches and
locks held across requests, evictions of each component and early SWA releases. kvjax's allocator
frees by ``free_segment`` when it has one, else ``free``. After every op the return values (prefix
lengths, slot ids in order, evicted counts) and every size (evictable / protected per component,
free slots per pool) must be equal; the first difference stops the stream and is reported with the
ops that led to it.

Prints JSON: per configuration the streams and ops run, the streams identical, and the first
difference. Last full runs (10 streams of 2,000 ops, seeds 1 and 2): every stream of every
configuration identical (6 allocator, 3 FULL, 9 SWA, 6 Mamba, 12 host-tier configurations). With
the eviction policies (issue 35; 10 streams of 1,000 ops, seed 0): every ``lifecycle`` stream on
SGLang's ``RadixCache`` identical under all 7 policies at pages 1, 4, 16 (210 streams), and on its
``UnifiedRadixCache`` and in the ``full`` kind under lru, lfu, mru, priority and slru; fifo and
filo differ on ``UnifiedRadixCache`` only: its split gives the new parent the child's
``creation_time``, where its ``RadixCache`` (and kvjax) gives the parent a new one. ``--self-test``
replays the fixed cases of issues 19 and 35 (former differences and the host tier's known cases) and
says which differ. ``--sorted-frees`` (SGLang's ``free_segment`` as its sorted ``free``) is kept
to hide a free-order difference should one come back, so that the others show. Each stream is
seeded: ``--seed``.
"""

# The lambdas given to ``_TreePair.step`` run at once, inside the loop iteration that made them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
import traceback
import types
from array import array
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402
from compare_peers import _import_peer, _module_file, _SgRows  # type: ignore[import-not-found]  # noqa: E402

_M = "sglang.srt.mem_cache."
_SGLANG_REAL = {_M + m for m in (
    "unified_radix_cache", "base_prefix_cache", "radix_cache", "cache_init_params", "events", "utils",
    "evict_policy", "common", "hicache_storage", "unified_cache.component_type", "unified_cache.cache_action",
    "unified_cache.components", "unified_cache.components.base", "unified_cache.components.full",
    "unified_cache.components.swa", "unified_cache.components.mamba", "unified_cache.unified_tree_core",
    "unified_cache.unified_tree_core_interface", "unified_cache.tree_core_registry",
    "unified_cache.session_ref_tracker", "allocator", "allocator.base", "allocator.paged", "allocator.token",
    "allocator.swa", "allocator.mamba", "allocator.page_interleave",
)} | {
    "sglang.srt.environ", "sglang.srt.utils", "sglang.srt.utils.common", "sglang.srt.utils.invariants",
    "sglang.srt.session.streaming_session",
}  # fmt: skip
_MISSING_THIRD_PARTY = {"pybase64", "triton", "starlette"}
TRACE_KEEP, TRACE_SHOWN = 12, 8  # ops remembered / shown before a difference
# Pools of the tree streams: FULL slots (per page), SWA slots (half: eviction under pressure comes
# from the SWA side too) and Mamba state slots, small enough that allocations run short.
STATE_SLOTS = 8
# The eviction policies kvjax and SGLang 0.5.23 both have (SGLang's tlru is not in kvjax).
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")


class _CpuPlatform:
    """SGLang's ``current_platform`` on a CPU host without a device plugin: no Triton, no
    platform allocator class (SGLang then takes its own naive-torch paths)."""

    device_type = "cpu"
    capabilities = types.SimpleNamespace(supports_triton=False, graph_capture=False)

    @staticmethod
    def get_paged_allocator_cls():
        return None

    @staticmethod
    def is_out_of_tree():
        return False


# The server settings SGLang's Mamba component reads at construction (set per tree).
_EXEC = types.SimpleNamespace(
    mamba=types.SimpleNamespace(mamba_max_states_per_path=-1, enable_mamba_extra_buffer_lazy=False),
    mamba_chunk=1,  # the model's mamba chunk: the tree page here (kvjax's default)
)

_SG: types.SimpleNamespace | None = None


class _SWAPoolStub:
    """What SGLang's SWA allocator asks of its ``SWAKVPool`` (no device buffers): no
    per-request ring, and the full-to-SWA slot mapping it registers, for translations. Its
    methods are copied onto a subclass of the placeholder ``BaseSWAKVPool`` (the allocator
    checks ``isinstance``)."""

    swa_req_ring_size = None
    full_kv_pool = None
    swa_kv_pool = None
    full_to_swa_index_mapping = None

    def register_mapping(self, mapping):
        self.full_to_swa_index_mapping = mapping

    def translate_loc_from_full_to_swa(self, kv_indices):
        return self.full_to_swa_index_mapping[kv_indices]


# ``--sorted-frees``: SGLang's ``free_segment`` replaced by its plain ``free`` (sorted per page),
# on its allocators and inside its tree, so that differences other than the order of segment frees
# show (known difference 1 of issue 19 masks everything after the first tree eviction otherwise).
SORTED_FREES = False


def _sorted_frees(alloc: Any) -> Any:
    if SORTED_FREES:
        for a in (alloc, getattr(alloc, "full_attn_allocator", None), getattr(alloc, "swa_attn_allocator", None)):
            if a is not None:
                a.free_segment = lambda ids, start_pos=0, _a=a: _a.free(ids)
                a.free_full_segment = lambda ids, start_pos=0, _a=alloc: _a.free_full(ids)
    return alloc


def load_sglang(path: str) -> types.SimpleNamespace:
    """SGLang's modules used here (imported once per process)."""
    global _SG
    if _SG is not None:
        return _SG
    import torch

    logging.getLogger("sglang").setLevel(logging.ERROR)  # its write_back host-pressure warnings
    real = {m for m in _SGLANG_REAL if _module_file(path, m)}
    presets = {
        "sglang.srt.platforms": {"current_platform": _CpuPlatform},
        "sglang.srt.runtime_context": {
            "get_exec": lambda: _EXEC,
            "mamba_cache_chunk_size": lambda: _EXEC.mamba_chunk,
            "mamba_checkpoint_grid": lambda tree_page: math.lcm(_EXEC.mamba_chunk, tree_page),
        },
    }
    mods, placeholders = _import_peer(path, "sglang", real, _MISSING_THIRD_PARTY, presets)
    memory_pool = sys.modules["sglang.srt.mem_cache.memory_pool"]
    swa_pool = sys.modules["sglang.srt.mem_cache.base_swa_memory_pool"]
    _SG = types.SimpleNamespace(
        torch=torch,
        urc=mods[_M + "unified_radix_cache"],
        bp=mods[_M + "base_prefix_cache"],
        rc=mods[_M + "radix_cache"],
        ct=mods[_M + "unified_cache.component_type"].ComponentType,
        params=mods[_M + "cache_init_params"].CacheInitParams,
        token=mods[_M + "allocator.token"].TokenToKVPoolAllocator,
        paged=mods[_M + "allocator.paged"].PagedTokenToKVPoolAllocator,
        swa=mods[_M + "allocator.swa"].SWATokenToKVPoolAllocator,
        mamba_slots=mods[_M + "allocator.mamba"].MambaSlotAllocator,
        hybrid_pool_cls=memory_pool.HybridReqToTokenPool,
        swa_kv_pool_cls=swa_pool.BaseSWAKVPool,
        placeholders=sorted(set(placeholders)),
    )
    return _SG


def _sg() -> types.SimpleNamespace:
    if _SG is None:
        raise RuntimeError("call load_sglang(path) first")
    return _SG


def _ids(x: Any) -> list[int] | None:
    if x is None:
        return None
    return [int(v) for v in np.asarray(x.tolist() if hasattr(x, "tolist") else x).ravel()]


class Mismatch(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Allocators


class _AllocSide:
    """What both allocator sides do alike on their allocator ``a``."""

    a: Any

    def alloc(self, n):
        return _ids(self.a.alloc(n))

    def group_begin(self):
        self.a.free_group_begin()

    def group_end(self):
        self.a.free_group_end()

    def sizes(self):
        return {"available": int(self.a.available_size())}


class _SgAlloc(_AllocSide):
    """SGLang's token (page 1) or paged allocator, called as its scheduler calls it."""

    def __init__(self, size: int, page: int, need_sort: bool) -> None:
        sg = _sg()
        self.t, self.page = sg.torch, page
        if page == 1:
            self.a = sg.token(size, self.t.int64, "cpu", None, need_sort)
        else:
            self.a = sg.paged(size, page, self.t.int64, "cpu", None, need_sort)
        _sorted_frees(self.a)

    def _t(self, ids):
        return self.t.tensor(ids, dtype=self.t.int64)

    def alloc_extend(self, prefix, seq, last):
        if self.page == 1:
            return _ids(self.a.alloc(sum(seq) - sum(prefix)))
        p, s = self._t(prefix), self._t(seq)
        return _ids(self.a.alloc_extend(p, p.clone(), s, s.clone(), self._t(last), sum(seq) - sum(prefix)))

    def alloc_decode(self, seq, last):
        if self.page == 1:
            return _ids(self.a.alloc(len(seq)))
        s = self._t(seq)
        return _ids(self.a.alloc_decode(s, s.clone(), self._t(last)))

    def free(self, ids):
        self.a.free(self._t(ids))

    def free_segment(self, ids, start):
        self.a.free_segment(self._t(ids), start_pos=start)


class _KvAlloc(_AllocSide):
    """kvjax's allocator; ``free_segment`` when it has one (SGLang's semantics), else ``free``."""

    def __init__(self, size: int, page: int, need_sort: bool) -> None:
        from kvjax.alloc import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

        self.a = (
            TokenToKVPoolAllocator(size, need_sort=need_sort)
            if page == 1
            else PagedTokenToKVPoolAllocator(size, page, need_sort=need_sort)
        )

    def alloc_extend(self, prefix, seq, last):
        return _ids(self.a.alloc_extend(prefix, seq, last))

    def alloc_decode(self, seq, last):
        return _ids(self.a.alloc_decode(seq, last))

    def free(self, ids):
        self.a.free(np.asarray(ids, np.int64))

    def free_segment(self, ids, start):
        free_segment(self.a, ids, start)


def free_segment(alloc: Any, ids: Any, start: int = 0) -> None:
    """kvjax: ``alloc.free_segment`` where it exists (SGLang's row-order page free), else ``free``."""
    ids = np.asarray(ids, np.int64)
    if ids.size == 0:
        return
    fs = getattr(alloc, "free_segment", None)
    if fs is None:
        alloc.free(ids)
        return
    try:
        fs(ids, start_pos=start)
    except TypeError:
        fs(ids)


class _Pair:
    """Runs each op on both sides, compares results and sizes, keeps a short trace."""

    def __init__(self, sg: Any, kv: Any, trace_len: int = 12) -> None:
        self.sg, self.kv = sg, kv
        self.trace: list[str] = []
        self.n = 0
        self.trace_len = trace_len

    def call(self, name: str, *args: Any, show: str | None = None) -> Any:
        self.n += 1
        label = f"#{self.n} {name}({show if show is not None else ', '.join(map(_short, args))})"
        r_sg = getattr(self.sg, name)(*args)
        r_kv = getattr(self.kv, name)(*args)
        self.trace.append(f"{label} -> {_short(r_sg)}")
        self.trace = self.trace[-self.trace_len :]
        if r_sg != r_kv:
            raise Mismatch(f"{label}: SGLang {_short(r_sg)}, kvjax {_short(r_kv)}")
        s_sg, s_kv = self.sg.sizes(), self.kv.sizes()
        if s_sg != s_kv:
            raise Mismatch(f"{label} -> {_short(r_sg)}; sizes after it: SGLang {s_sg}, kvjax {s_kv}")
        return r_sg


def _checkpoint_cut(req: dict, rng: random.Random, page: int) -> tuple[list, Any, list, int, str]:
    """A chunked-prefill checkpoint of the live request ``req``: its key cut after a random number
    (at least one) of whole pages past its hit. Returns ``(key part, ns, the part's values, hit,
    the insert's label)``; draws one number from ``rng``."""
    key, ns, vals, hit = req["key"], req["ns"], req["values"], req["hit"]
    cut = hit + page * rng.randrange(1, (len(key) - hit) // page + 1)
    part, part_vals = key[:cut], vals[:cut]
    label = f"insert(key={_short(part)}, ns={ns}, value={_short(part_vals)}, prev_prefix_len={hit}) (checkpoint)"
    return part, ns, part_vals, hit, label


def _request_op(
    r: float,
    rng: random.Random,
    pair: _TreePair,
    live: list[dict],
    held: list[tuple],
    *,
    ops: tuple[Callable[[], None], Callable[[dict], None], Callable[[dict], None], Callable[[dict], None] | None],
    key_of: Callable[[], tuple[list[int], Any]],
    page: int,
    most: tuple[int, int],
    bounds: tuple[float, float, float, float, float, float],
) -> bool:
    """The request part of a tree stream's op mix for the draw ``r``; ``bounds`` are its six cut
    points, ``ops`` are (admit, finish, retract, checkpoint), ``most`` the (live requests, held
    locks) at most. In turn: admit a request (or finish a random one when ``most[0]`` run; also
    whenever none is live), finish one, retract one, checkpoint one that has a page past its hit
    (no checkpoint op: that share goes to the next op), match a key of ``key_of()`` and maybe hold
    its lock, unlock a held lock (none held: the share goes on). Returns False when ``r`` is past
    them (the caller's other ops take it)."""
    admit, finish, retract, checkpoint = ops
    if r < bounds[0] or not live:
        if len(live) < most[0]:
            admit()
        else:
            finish(live.pop(rng.randrange(len(live))))
    elif r < bounds[1]:
        finish(live.pop(rng.randrange(len(live))))
    elif r < bounds[2]:
        retract(live.pop(rng.randrange(len(live))))
    elif r < bounds[3] and checkpoint is not None:
        req = rng.choice(live)
        if len(req["key"]) - req["hit"] >= page:
            checkpoint(req)
    elif r < bounds[4]:
        pair.match_maybe_held(*key_of(), rng, held, most=most[1])
    elif r < bounds[5] and held:
        pair.unlock("unlock(held lock)", held.pop(rng.randrange(len(held))))
    else:
        return False
    return True


def _short(x: Any, limit: int = 24) -> str:
    if isinstance(x, list) and len(x) > limit:
        return "[" + ", ".join(map(str, x[:limit])) + f", ... ({len(x)})]"
    if isinstance(x, tuple):
        return "(" + ", ".join(_short(v, limit) for v in x) + ")"
    return str(x)


def alloc_stream(page: int, need_sort: bool, seed: int, ops: int) -> tuple[int, str | None]:
    """One random stream on both allocators; returns (ops run, first difference or None)."""
    rng = random.Random(seed)
    size = 64 * page if page > 1 else 64
    pair = _Pair(_SgAlloc(size, page, need_sort), _KvAlloc(size, page, need_sort))
    rows: list[list[int]] = []
    grouped = False
    try:
        for _ in range(ops):
            r = rng.random()
            if r < 0.2:
                got = pair.call("alloc", page * rng.randrange(1, 5))
                if got:
                    rows.append(got)
            elif r < 0.4:
                batch = rng.sample(range(len(rows) + 2), k=min(rng.randrange(1, 4), len(rows) + 2))
                prefix, seq, last, who = [], [], [], []
                for b in batch:
                    row = rows[b] if b < len(rows) else []
                    prefix.append(len(row))
                    seq.append(len(row) + rng.randrange(0, 3 * page + 2))
                    last.append(row[-1] if row else -1)
                    who.append(b)
                got = pair.call("alloc_extend", prefix, seq, last)
                if got is not None:
                    pos, n_rows = 0, len(rows)
                    for b, p, s in zip(who, prefix, seq, strict=True):
                        new = got[pos : pos + s - p]
                        pos += s - p
                        if b < n_rows:
                            rows[b].extend(new)
                        elif new:
                            rows.append(new)
            elif r < 0.5 and rows:
                who = rng.sample(range(len(rows)), k=min(rng.randrange(1, 4), len(rows)))
                got = pair.call("alloc_decode", [len(rows[b]) + 1 for b in who], [rows[b][-1] for b in who])
                if got is not None:
                    for b, slot in zip(who, got, strict=True):
                        rows[b].append(slot)
            elif r < 0.85 and rows:
                b = rng.randrange(len(rows))
                row = rows[b]
                cut = rng.choice([0, 0, page * rng.randrange(0, len(row) // page + 1)])
                cut = min(cut, len(row)) // page * page
                tail = row[cut:]
                if rng.random() < 0.6:
                    pair.call("free_segment", tail, cut, show=f"{_short(tail)}, start_pos={cut}")
                else:
                    pair.call("free", tail)
                if cut:
                    rows[b] = row[:cut]
                else:
                    rows.pop(b)
            elif r < 0.95:
                if grouped:
                    pair.call("group_end")
                else:
                    pair.call("group_begin")
                grouped = not grouped
            else:
                pair.call("alloc", page)
    except Mismatch as e:
        return pair.n, _report(e, pair)
    except Exception as e:  # a crash on one side is a difference too
        return pair.n, _crash(e, pair.n, pair.trace)
    return pair.n, None


def _crash(e: Exception, n: int, trace: list[str]) -> str:
    where = " <- ".join(
        f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
        for f in reversed(traceback.extract_tb(e.__traceback__)[-4:])
    )
    return f"#{n + 1}: {type(e).__name__}: {e} (at {where})\n  ops before it: " + " | ".join(trace[-TRACE_SHOWN:])


def _report(e: Exception, pair: _Pair | _TreePair) -> str:
    return f"{e}\n  ops before it: " + " | ".join(pair.trace[:-1][-TRACE_SHOWN:])


# ---------------------------------------------------------------------------------------------
# Trees


class _TreeSide:
    """What both tree sides report alike: the free pools and the SWA / recurrent components' sizes."""

    kind: str
    alloc: Any
    tree: Any
    mamba: Any

    def available(self):
        if self.kind == "swa":
            return int(self.alloc.full_available_size()), int(self.alloc.swa_available_size())
        return (int(self.alloc.available_size()),)

    def _with_component_sizes(self, out: dict) -> dict:
        """``out`` (the FULL sizes and the free pools) with the SWA or recurrent component's sizes."""
        t = self.tree
        if self.kind == "swa":
            out["swa"] = (int(t.swa_evictable_size()), int(t.swa_protected_size()))
        if self.kind == "mamba":
            out["mamba"] = (int(t.mamba_evictable_size()), int(t.mamba_protected_size()))
            out["state_slots_free"] = int(self.mamba.available_size())
        return out


class _SgTree(_TreeSide):
    """SGLang's ``UnifiedRadixCache`` with its real allocators."""

    def __init__(
        self, kind: str, page: int, size: int, window: int = 0, max_states: int = -1, need_sort=False, policy="lru"
    ):
        sg = _sg()
        self.sg, self.t, self.kind, self.page = sg, sg.torch, kind, page
        ct = sg.ct
        comps = (ct.FULL,)
        kw: dict[str, Any] = {}
        pool = None
        if kind == "swa":
            # The SWA pool as its allocator sees it: no per-request ring, no device buffers.
            kvcache = type("SWAPoolStub", (sg.swa_kv_pool_cls,), dict(_SWAPoolStub.__dict__))()
            self.alloc = sg.swa(size, size // 2, page, self.t.int64, "cpu", kvcache, need_sort)
            comps = (ct.FULL, ct.SWA)
            kw["sliding_window_size"] = window
        else:
            self.alloc = (
                sg.token(size, self.t.int64, "cpu", None, need_sort)
                if page == 1
                else sg.paged(size, page, self.t.int64, "cpu", None, need_sort)
            )
        _sorted_frees(self.alloc)
        if kind == "mamba":
            pool = type("HybridPool", (sg.hybrid_pool_cls,), {"mamba_ckpt_pool": None})()  # no int8 checkpoints
            pool.mamba_allocator = sg.mamba_slots(STATE_SLOTS, "cpu")
            self.mamba = pool.mamba_allocator
            comps = (ct.FULL, ct.MAMBA)
            kw["enable_mamba_extra_buffer"] = page > 1
            _EXEC.mamba.mamba_max_states_per_path = max_states
            _EXEC.mamba_chunk = page
        self.tree = sg.urc.UnifiedRadixCache(
            sg.params(
                disable=False,
                req_to_token_pool=pool,
                token_to_kv_pool_allocator=self.alloc,
                page_size=page,
                tree_components=comps,
                tree_core_backend="python",
                eviction_policy=policy,
                **kw,
            )
        )

    def _key(self, key, ns):
        return self.sg.rc.RadixKey(array("q", key), extra_key=ns)

    def alloc_tokens(self, n, prefix=0, last=-1):
        if self.kind == "swa" and self.page > 1:  # SGLang's paged SWA allocator only extends
            p = self.t.tensor([prefix], dtype=self.t.int64)
            s = self.t.tensor([prefix + n], dtype=self.t.int64)
            last_t = self.t.tensor([last], dtype=self.t.int64)
            return _ids(self.alloc.alloc_extend(p, p.clone(), s, s.clone(), last_t, n))
        return _ids(self.alloc.alloc(n))

    def alloc_state(self):
        got = self.mamba.alloc(1)
        return None if got is None else int(got[0])

    def make_room(self, need):
        """The scheduler's eviction before an allocation of ``need`` tokens (SGLang's allocator
        hook ``evict_to_free_tokens``: ``evict_for_alloc`` with the shortfalls as targets)."""
        self.alloc.evict_to_free_tokens(self.tree, need)

    def free_state(self, slot):
        self.mamba.free(self.t.tensor([slot], dtype=self.t.int64))

    def free_segment(self, ids, start):
        if ids:
            self.alloc.free_segment(self.t.tensor(ids, dtype=self.t.int64), start_pos=start)

    def match(self, key, ns):
        m = self.tree.match_prefix(self.sg.bp.MatchPrefixParams(key=self._key(key, ns)))
        node = m.last_device_node
        idx = _ids(self.tree.tree_core.collect_full_device_indices(node, self.tree.root_node_handle(ns)))
        return (int(m.device_prefix_len), idx[: int(m.device_prefix_len)], int(m.full_kv_hit_length)), node

    def insert(self, key, ns, values, prev, mamba_value=None, priority=0):
        p = self.sg.bp.InsertParams(
            key=self._key(key, ns),
            value=self.t.tensor(values, dtype=self.t.int64),
            prev_prefix_len=prev,
            priority=priority,
        )
        if mamba_value is not None:
            p.mamba_value = self.t.tensor([mamba_value], dtype=self.t.int64)
        r = self.tree.insert(p)
        return int(r.prefix_len), bool(getattr(r, "mamba_exist", False))

    def checkpoint(self, key, ns, values, prev, priority=0):
        """SGLang 0.5.23's ``checkpoint_into_tree``: insert, then protect the whole inserted
        path from the node the insert ended on (a match there can stop short at SWA
        tombstones); returns ((prefix_len, the path's slots), that node)."""
        r = self.tree.insert(
            self.sg.bp.InsertParams(
                key=self._key(key, ns),
                value=self.t.tensor(values, dtype=self.t.int64),
                prev_prefix_len=prev,
                priority=priority,
            )
        )
        node = r.last_device_node
        path = _ids(self.tree.tree_core.collect_full_device_indices(node, self.tree.root_node_handle(ns)))
        return (int(r.prefix_len), path), node

    def lock(self, node):
        return self.tree.lock(node)

    def unlock(self, lock):
        self.tree.unlock(lock)

    def release_swa(self, lock):
        """SGLang's ``release_swa_prefix_lock``: only a lock with an SWA part, once."""
        if lock is not None and lock.receipt.component_lock_uuids.get(self.sg.ct.SWA) is not None:
            self.tree.release_swa(lock)

    def evict(self, full, other):
        bp = self.sg.bp
        if self.kind == "swa":
            r = self.tree.evict(bp.EvictParams(num_tokens=full, swa_num_tokens=other))
            return int(r.num_tokens_evicted), int(r.swa_num_tokens_evicted)
        if self.kind == "mamba":
            r = self.tree.evict(bp.EvictParams(num_tokens=full, mamba_num=other))
            return int(r.num_tokens_evicted), int(r.mamba_num_evicted)
        return int(self.tree.evict(bp.EvictParams(num_tokens=full)).num_tokens_evicted), 0

    def sizes(self):
        t = self.tree
        full = (int(t.full_evictable_size()), int(t.full_protected_size()))
        return self._with_component_sizes({"full": full, "free": self.available()})


class _KvTree(_TreeSide):
    """kvjax's tree of the same kind with its allocators."""

    def __init__(
        self, kind: str, page: int, size: int, window: int = 0, max_states: int = -1, need_sort=False, policy="lru"
    ):
        from kvjax.alloc import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
        from kvjax.radix import MambaRadixCache, RadixCache, SWARadixCache

        self.kind, self.page = kind, page
        if kind == "swa":
            self.alloc = SWATokenToKVPoolAllocator(size, size // 2, page, need_sort=need_sort)
            self.tree = SWARadixCache(page_size=page, sliding_window_size=window, allocator=self.alloc)
            return
        self.alloc = (
            TokenToKVPoolAllocator(size, need_sort=need_sort)
            if page == 1
            else PagedTokenToKVPoolAllocator(size, page, need_sort=need_sort)
        )
        if kind == "mamba":
            self.tree = MambaRadixCache(
                page_size=page,
                token_to_kv_pool_allocator=self.alloc,
                mamba_pool_size=STATE_SLOTS,
                mamba_max_states_per_path=max_states,
                enable_mamba_extra_buffer=page > 1,
            )
            self.mamba = self.tree.mamba_allocator
        else:
            self.tree = RadixCache(page_size=page, token_to_kv_pool_allocator=self.alloc, eviction_policy=policy)

    def alloc_tokens(self, n, prefix=0, last=-1):
        if self.kind == "swa" and self.page > 1:
            return _ids(self.alloc.alloc_extend([prefix], [prefix + n], [last]))
        return _ids(self.alloc.alloc(n))

    def alloc_state(self):
        got = self.mamba.alloc(1)
        return None if got is None else int(np.asarray(got).ravel()[0])

    def make_room(self, need):
        """kvjax's allocator hook where it has one (SWA), else a FULL eviction of the shortfall
        (what kvjax's scheduler does)."""
        hook = getattr(self.alloc, "evict_to_free_tokens", None)
        if hook is not None:
            hook(self.tree, need)
        else:
            self.tree.evict(max(0, need - self.available()[0]))

    def free_state(self, slot):
        self.mamba.free(np.asarray([slot], np.int64))

    def free_segment(self, ids, start):
        free_segment(self.alloc, ids, start)

    def match(self, key, ns):
        m = self.tree.match_prefix(list(key), extra_key=ns)
        return (int(m.prefix_len), _ids(m.indices), int(m.full_kv_hit_length)), m.last_node

    def insert(self, key, ns, values, prev, mamba_value=None, priority=0):
        if self.kind == "swa":  # SWARadixCache frees the duplicates past prev itself, as SGLang's
            return int(self.tree.insert(list(key), np.asarray(values, np.int64), ns, prev_prefix_len=prev)), False
        if self.kind == "mamba":
            r = self.tree.insert(list(key), np.asarray(values, np.int64), ns, mamba_value=mamba_value)
            got, exist = int(r.prefix_len if hasattr(r, "prefix_len") else r[0]), bool(r.mamba_exist)
        else:
            got, exist = int(self.tree.insert(list(key), np.asarray(values, np.int64), ns, priority)), False
        # The caller's slots of the already-cached part past what it matched are duplicates: kvjax's
        # lifecycle (cache_finished_req) frees them with the tree's _free_duplicates, node by node
        # from the top, as SGLang's unified tree does inside insert.
        if got > prev:
            vals = np.asarray(values, np.int64)
            self.tree._free_duplicates(self.tree.last_insert_node, vals[prev:got], prev, got, 0)
        return got, exist

    def checkpoint(self, key, ns, values, prev, priority=0):
        """kvjax's ``cache_unfinished_req`` step: insert (duplicates freed as in :meth:`insert`),
        then the node the insert ended on and its root path's slots."""
        got, _ = self.insert(key, ns, values, prev, priority=priority)
        node = self.tree.last_insert_node
        parts = []
        walk = node
        while walk is not self.tree.root:
            parts.append(np.asarray(walk.value, np.int64))
            walk = walk.parent
        path = [int(v) for v in np.concatenate(parts[::-1])] if parts else []
        return (got, path), node

    def lock(self, node):
        return self.tree.inc_lock_ref(node)

    def unlock(self, receipt):
        self.tree.dec_lock_ref(receipt)

    def release_swa(self, receipt):
        self.tree.dec_swa_lock_only(receipt)

    def evict(self, full, other):
        if self.kind == "swa":
            r = self.tree.evict(full, other)
            return int(r[0]), int(r[1])
        if self.kind == "mamba":
            r = self.tree.evict(full, other)
            return int(r.num_tokens_evicted), int(r.mamba_num_evicted)
        return int(self.tree.evict(full)), 0

    def sizes(self):
        t = self.tree
        if self.kind == "full":
            full = (int(t.evictable_size()), int(t.protected_size()))
        else:
            full = (int(t.full_evictable_size()), int(t.full_protected_size()))
        return self._with_component_sizes({"full": full, "free": self.available()})


class _TreePair:
    """Both trees; handles (nodes, locks) are kept per side, results compared."""

    def __init__(self, sg: _SgTree, kv: _KvTree) -> None:
        self.sg, self.kv = sg, kv
        self.trace: list[str] = []
        self.n = 0

    def step(self, label: str, f: Callable[[Any], Any], compare: Callable[[Any], Any] = lambda r: r) -> tuple:
        self.n += 1
        label = f"#{self.n} {label}"
        r_sg, r_kv = f(self.sg), f(self.kv)
        c_sg, c_kv = compare(r_sg), compare(r_kv)
        self.trace.append(f"{label} -> {_short(c_sg)}")
        self.trace = self.trace[-TRACE_KEEP:]
        if c_sg != c_kv:
            raise Mismatch(f"{label}: SGLang {_short(c_sg)}, kvjax {_short(c_kv)}")
        s_sg, s_kv = self.sg.sizes(), self.kv.sizes()
        if s_sg != s_kv:
            raise Mismatch(f"{label} -> {_short(c_sg)}; sizes after it: SGLang {s_sg}, kvjax {s_kv}")
        return r_sg, r_kv

    def side(self, s: Any, handles: tuple) -> Any:
        """The one of ``handles`` (SGLang's, kvjax's: nodes or locks) that belongs to the tree ``s``."""
        return handles[0] if s is self.sg else handles[1]

    def lock(self, label: str, nodes: tuple) -> tuple:
        """Lock each side's node of ``nodes``; returns the two locks."""
        return self.step(label, lambda s: s.lock(self.side(s, nodes)), lambda r: None)

    def unlock(self, label: str, locks: tuple) -> None:
        self.step(label, lambda s: s.unlock(self.side(s, locks)), lambda r: None)

    def alloc_tokens(self, need: int, *args: Any) -> Any:
        """Allocate ``need`` token slots, evicting to make room and trying again when short
        (the scheduler's order); SGLang's slots, or None when still short."""
        new, _ = self.step(f"alloc({need})", lambda s: s.alloc_tokens(need, *args))
        if new is None:
            self.step(f"evict_to_free_tokens({need})", lambda s: s.make_room(need))
            new, _ = self.step(f"alloc({need}) after eviction", lambda s: s.alloc_tokens(need, *args))
        return new

    def match_maybe_held(self, key: list[int], ns: Any, rng: random.Random, held: list, most: int) -> None:
        """A plain match; 30% of the time, while fewer than ``most`` are held, its node is locked
        and the locks join ``held`` (released by a later op)."""
        (_, node_sg), (_, node_kv) = self.step(
            f"match(key={_short(key)}, ns={ns})", lambda s: s.match(key, ns), lambda r: r[0]
        )
        if rng.random() < 0.3 and len(held) < most:
            held.append(self.lock("lock(that match)", (node_sg, node_kv)))

    def free_own_slots(self, req: dict) -> None:
        """Free a request's own slots (those past its prefix hit), as a retraction does."""
        new, hit = req["values"][req["hit"] :], req["hit"]
        self.step(f"free_segment({_short(new)}, start_pos={hit})", lambda s: s.free_segment(new, hit), lambda r: None)

    def run(self, ops: int, one_op: Callable[[], None]) -> tuple[int, str | None]:
        """Call ``one_op`` until ``ops`` ops ran; returns (ops run, the first difference or None).
        A crash on one side is a difference too."""
        try:
            while self.n < ops:
                one_op()
        except Mismatch as e:
            return self.n, _report(e, self)
        except Exception as e:
            return self.n, _crash(e, self.n, self.trace)
        return self.n, None


def tree_stream(
    kind: str, page: int, seed: int, ops: int, window: int = 0, max_states: int = -1, policy: str | None = None
) -> tuple[int, str | None]:
    """One random request stream through both trees; returns (ops run, first difference or None).
    ``policy``: both trees' eviction policy (None: lru, and requests without priorities); with a
    policy every admitted request draws a priority (0 to 2) that its inserts carry."""
    rng = random.Random(seed)
    size = (48 * page if page > 1 else 64) if kind != "mamba" else (24 * page if page > 1 else 32)
    pol = policy or "lru"
    pair = _TreePair(
        _SgTree(kind, page, size, window, max_states, policy=pol),
        _KvTree(kind, page, size, window, max_states, policy=pol),
    )
    vocab = 3
    prompts = [[rng.randrange(vocab) for _ in range(page * rng.randrange(1, 4))] for _ in range(4)]
    live: list[dict] = []
    held: list[tuple] = []  # locks taken by bare match+lock ops

    def key_of():
        base = rng.choice(prompts)[: page * rng.randrange(0, 4)]
        tail = [rng.randrange(vocab) for _ in range(page * rng.randrange(0 if base else 1, 4))]
        return base + tail, rng.choice([None, None, "ns"])

    def admit():
        key, ns = key_of()
        show = f"key={_short(key)}, ns={ns}"
        (m, node_sg), (_, node_kv) = pair.step(f"match({show})", lambda s: s.match(key, ns), lambda r: r[0])
        hit, idx = m[0], m[1]
        locks = pair.lock("lock(that match)", (node_sg, node_kv))
        need = len(key) - hit
        state = None
        if kind == "mamba":
            state, _ = pair.step("alloc_state()", lambda s: s.alloc_state())
            if state is None:  # the scheduler evicts one checkpoint and tries again
                pair.step("evict(0, 1)", lambda s: s.evict(0, 1))
                state, _ = pair.step("alloc_state() after eviction", lambda s: s.alloc_state())
            if state is None:
                pair.unlock("unlock(that lock)", locks)
                return
        new = pair.alloc_tokens(need, hit, idx[-1] if idx else -1)
        if new is None:
            pair.unlock("unlock(that lock)", locks)
            if state is not None:
                pair.step(f"free_state({state})", lambda s: s.free_state(state), lambda r: None)
            return
        prio = rng.randrange(3) if policy is not None else 0
        live.append(
            {"key": key, "ns": ns, "hit": hit, "values": idx + new, "locks": locks, "state": state, "prio": prio}
        )

    def finish(req):
        key, ns, vals, hit = req["key"], req["ns"], req["values"], req["hit"]
        prio = req["prio"]
        r, _ = pair.step(
            f"insert(key={_short(key)}, ns={ns}, value={_short(vals)}, prev_prefix_len={hit}"
            + (f", priority={prio})" if prio else ")"),
            lambda s: s.insert(key, ns, vals, hit, req["state"], prio),
        )
        if req["state"] is not None and r[1]:
            pair.step(
                f"free_state({req['state']}) (checkpoint existed)", lambda s: s.free_state(req["state"]), lambda r: None
            )
        pair.unlock("unlock(request)", req["locks"])

    def retract(req):
        pair.free_own_slots(req)
        if req["state"] is not None:
            pair.step(f"free_state({req['state']})", lambda s: s.free_state(req["state"]), lambda r: None)
        pair.unlock("unlock(request)", req["locks"])

    def checkpoint(req):
        """A chunked-prefill checkpoint (SGLang 0.5.23's ``checkpoint_into_tree``): insert the
        first ``cut`` tokens, unlock, lock the node the insert ended on; the request's row then
        holds the tree's slots for the whole inserted part, all of it protected. (Not a re-match:
        one can stop short at SWA tombstones and leave slots of the row unprotected, which a
        later revival frees under the request.)"""
        part, ns, part_vals, hit, label = _checkpoint_cut(req, rng, page)
        prio = req["prio"]
        if prio:
            label = label.replace(") (checkpoint)", f", priority={prio}) (checkpoint)")
        (m, node_sg), (_, node_kv) = pair.step(
            label, lambda s: s.checkpoint(part, ns, part_vals, hit, prio), lambda r: r[0]
        )
        pair.unlock("unlock(request)", req["locks"])
        req["locks"] = pair.lock("lock(the inserted node)", (node_sg, node_kv))
        req["values"] = m[1] + req["values"][len(m[1]) :]
        req["hit"] = len(m[1])

    def one_op():
        r = rng.random()
        ops = (admit, finish, retract, checkpoint if kind != "mamba" else None)
        bounds = (0.35, 0.6, 0.67, 0.72, 0.78, 0.8)
        if _request_op(r, rng, pair, live, held, ops=ops, key_of=key_of, page=page, most=(5, 3), bounds=bounds):
            return
        if r < 0.9:
            full = rng.choice([0, page, 3 * page, 8 * page])
            other = rng.choice([0, 1, page, 4 * page]) if kind != "full" else 0
            if kind == "mamba":
                other = rng.choice([0, 1, 2])
            pair.step(f"evict({full}, {other})", lambda s: s.evict(full, other))
        elif kind == "swa" and live:
            # SGLang's scheduler releases every decode request's SWA lock once past the window
            # (release_swa_prefix_lock): locks without an SWA part and repeats included.
            locks = rng.choice(live)["locks"]
            pair.step("release_swa(request lock)", lambda s: s.release_swa(pair.side(s, locks)), lambda r: None)
        else:
            key, ns = key_of()
            pair.step(f"match(key={_short(key)}, ns={ns})", lambda s: s.match(key, ns)[0], lambda r: r)

    return pair.run(ops, one_op)


# ---------------------------------------------------------------------------------------------
# The request lifecycle over real allocators: SGLang 0.5.23's ``RadixCache`` (or its
# ``UnifiedRadixCache`` with FULL alone) driven as its ``mem_cache/common.py`` drives it
# (``checkpoint`` / ``release_kv_cache``) over its real token or paged allocator, next to kvjax's
# ``RadixCache`` lifecycle over kvjax's allocator, under every eviction policy, with request
# priorities.


def lifecycle_stream(
    policy: str, page: int, seed: int, ops: int, unified: bool = False, size: int = 0, live_max: int = 4
) -> tuple[int, str | None]:
    """One random request stream through both lifecycles: admissions with a priority (-1 to 2;
    match, lock, ``alloc_extend`` of the rest, a chunked checkpoint, a checkpoint of the whole
    prompt), decodes (``alloc_extend`` of one token, a checkpoint after each), finishes,
    retractions, evictions of 1 to 16 pages, and the scheduler's eviction under allocation
    pressure (the allocator's ``evict_to_free_tokens``, then a second try). After every op the
    slots ``alloc_extend`` handed out (in order), the match, the evicted counts, the free slots
    and the tree's evictable / protected sizes must be equal; at the end the trees (node
    boundaries, slots, priorities, hit counts), then everything evicted and the whole pool
    allocated (the free list's order). ``unified``: SGLang's side is its ``UnifiedRadixCache``
    (FULL, the Python tree core) instead of its ``RadixCache``. ``size``: the pool's slots
    (default 128 at page 1, 32 pages above). Odd seeds draw the prompts' tails and the decoded
    tokens from 3 values (requests share pages, outputs included), even seeds from 50. Returns
    (ops run, the first difference or None)."""
    from kvjax.radix import RadixCache
    from kvjax.req_pool import ReqToTokenPool
    from kvjax.request import Req

    sg_mod = _sg()
    torch, rc, bp = sg_mod.torch, sg_mod.rc, sg_mod.bp
    rng = random.Random(seed)
    rows, width = 2 * live_max, 512
    size = size or (128 if page == 1 else 32 * page)
    vocab = 3 if seed % 2 else 50
    sg_alloc, kv_alloc = _SgAlloc(size, page, False), _KvAlloc(size, page, False)
    sg_rows = _SgRows(rows, width)
    kv_rows = ReqToTokenPool(rows, width)
    params = sg_mod.params(
        disable=False,
        req_to_token_pool=sg_rows,
        token_to_kv_pool_allocator=sg_alloc.a,
        page_size=page,
        eviction_policy=policy,
        **({"tree_components": (sg_mod.ct.FULL,), "tree_core_backend": "python"} if unified else {}),
    )
    sg = sg_mod.urc.UnifiedRadixCache(params) if unified else rc.RadixCache(params)
    kv = RadixCache(
        page_size=page, eviction_policy=policy, token_to_kv_pool_allocator=kv_alloc.a, req_to_token_pool=kv_rows
    )
    trace: list[str] = []
    n_ops = [0]

    def step(label: str, got_sg: Any, got_kv: Any) -> None:
        n_ops[0] += 1
        label = f"#{n_ops[0]} {label}"
        trace.append(f"{label} -> {_short(got_sg)}")
        del trace[:-TRACE_KEEP]
        if got_sg != got_kv:
            raise Mismatch(f"{label}: SGLang {_short(got_sg)}, kvjax {_short(got_kv)}")
        s_sg = (int(sg_alloc.a.available_size()), int(sg.evictable_size()), int(sg.protected_size()))
        s_kv = (int(kv_alloc.a.available_size()), int(kv.evictable_size()), int(kv.protected_size()))
        if s_sg != s_kv:
            raise Mismatch(f"{label}; (free, evictable, protected) after it: SGLang {s_sg}, kvjax {s_kv}")

    def evict(n: int, label: str) -> None:
        got_sg = int(sg.evict(bp.EvictParams(num_tokens=n)).num_tokens_evicted)
        step(label, got_sg, int(kv.evict(n)))

    def extend(prefix: int, seq: int, last_sg: int, last_kv: int) -> tuple[list[int], list[int]] | None:
        """``alloc_extend`` of positions ``[prefix, seq)``; when short, the scheduler's eviction of
        the shortfall and a second try. None when still short."""
        label = f"alloc_extend(prefix={prefix}, seq={seq})"
        for again in (False, True):
            got_sg = sg_alloc.alloc_extend([prefix], [seq], [last_sg])
            got_kv = kv_alloc.alloc_extend([prefix], [seq], [last_kv])
            step(label + (" after eviction" if again else ""), got_sg, got_kv)
            if got_sg is not None:
                return got_sg, got_kv
            if again:
                return None
            need = (-(-seq // page) - -(-prefix // page)) * page
            # The scheduler's eviction before an allocation: the allocator hook (SGLang:
            # ``evict_for_alloc`` of the shortfall; kvjax: ``evict`` of it).
            sg_alloc.a.evict_to_free_tokens(sg, need)
            kv_alloc.a.evict_to_free_tokens(kv, need)
            step(f"evict_to_free_tokens({need})", None, None)
        return None

    def checkpoint(s: Any, up_to: int) -> None:
        s.full_untruncated_fill_ids = array("q", s.tokens[:up_to])
        sg.checkpoint(s, up_to=up_to)

    def release(s: Any, k: Any, insert: bool) -> None:
        n = len(s.tokens)
        s.done = True
        if insert:
            checkpoint(s, n)
        start = s.kv.cache_protected_len
        sg_alloc.free_segment(sg_rows.req_to_token[s.kv.req_pool_idx][start:n].tolist(), start)
        sg.unlock(s.lock)
        kv.cache_finished_req(k, is_insert=insert)
        kv_rows.free(k.req_pool_idx)
        step(f"{'finish' if insert else 'retract'}({k.rid})", None, None)

    systems = [[rng.randrange(50) for _ in range(rng.choice([8, 16, 24]))] for _ in range(3)]
    live: list[tuple[Any, Any]] = []
    serial = 0

    def one_op() -> None:
        nonlocal serial
        r = rng.random()
        if r < 0.1:
            n = rng.choice([1, page, 4 * page, 16 * page])
            evict(n, f"evict({n})")
        elif live and (r < 0.45 or len(live) >= live_max):
            s, k = live[rng.randrange(len(live))]
            act = rng.random()
            if act < 0.5:  # decode 1-3 tokens, a checkpoint after each
                for _ in range(rng.randrange(1, 4)):
                    n = len(s.tokens)
                    row_sg = sg_rows.req_to_token[s.kv.req_pool_idx]
                    got = extend(n, n + 1, int(row_sg[n - 1]), int(kv_rows.req_to_token[k.req_pool_idx, n - 1]))
                    if got is None:
                        return
                    tok = rng.randrange(vocab)
                    s.tokens.append(tok)
                    k.output_ids.append(tok)
                    row_sg[n] = got[0][0]
                    kv_rows.req_to_token[k.req_pool_idx, n] = got[1][0]
                    checkpoint(s, n + 1)
                    k.kv_committed_len = n + 1
                    kv.cache_unfinished_req(k)
                    step(f"decode checkpoint({k.rid}, {n + 1})", None, None)
            else:  # finish (insert) or retract
                live.remove((s, k))
                release(s, k, insert=act < 0.9)
        else:
            serial += 1
            prompt = rng.choice(systems) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
            priority = rng.randrange(-1, 3)
            ns = rng.choice([None, None, "ns"])
            got_rows = kv_rows.alloc(1)
            assert got_rows is not None, "the request table has a row for every live request"
            row = int(got_rows[0])
            m = sg.match_prefix(bp.MatchPrefixParams(key=rc.RadixKey(array("q", prompt[:-1]), extra_key=ns)))
            hit = int(m.device_prefix_len)
            k = Req(f"r{serial}", list(prompt), req_pool_idx=row, priority=priority, extra_key=ns)
            km = kv.match_and_lock(k)
            prefix = sg.path_device_indices(m.last_device_node)
            s = types.SimpleNamespace(
                tokens=list(prompt),
                origin_input_ids=array("q", prompt) if unified else list(prompt),
                extra_key=ns,
                cache_salt=None,
                priority=priority,
                kv=types.SimpleNamespace(
                    req_pool_idx=row, cache_inserted_len=0, cache_protected_len=hit, swa_evict_floor=0
                ),
                lock=sg.lock(m.last_device_node),
                last_node=m.last_device_node,
                rid=k.rid,
                session=None,
                session_id=None,
                kv_rotation_base=None,
                done=False,
            )
            s.finished = lambda s=s: s.done
            step(
                f"match and lock({k.rid}, {len(prompt)} tokens)",
                (hit, prefix.tolist()),
                (km.prefix_len, _ids(km.indices)),
            )
            last_sg = int(prefix[-1]) if hit else -1
            last_kv = int(km.indices[-1]) if hit else -1
            got = extend(hit, len(prompt), last_sg, last_kv)
            if got is None:  # the scheduler leaves it waiting: give its lock and row back
                sg.unlock(s.lock)
                kv.dec_lock_ref(k.lock_receipt)
                kv_rows.free(row)
                step(f"retract({k.rid}) (no room)", None, None)
                return
            sg_rows.req_to_token[row, :hit] = prefix
            sg_rows.req_to_token[row, hit : len(prompt)] = torch.tensor(got[0])
            kv_rows.write(row, 0, km.indices)
            kv_rows.write(row, hit, np.array(got[1], np.int32))
            cut = rng.randrange(hit, len(prompt)) + 1  # a chunked-prefill checkpoint, then the rest
            checkpoint(s, cut)
            k.fill_ids = list(prompt[:cut])
            kv.cache_unfinished_req(k)
            k.fill_ids = None
            k.kv_committed_len = len(prompt)
            checkpoint(s, len(prompt))
            kv.cache_unfinished_req(k)
            step(f"admit({k.rid}, priority={priority}, checkpoints at {cut}, {len(prompt)})", None, None)
            live.append((s, k))

    try:
        while n_ops[0] < ops:
            one_op()
        while live:
            s, k = live.pop()
            release(s, k, insert=True)

        def sg_nodes(node: Any, depth: int, out: list) -> list:
            for c in node.children.values():
                value = c.component_data[sg_mod.ct.FULL].value if unified else c.value
                out.append((depth + len(c.key), len(c.key), c.priority, c.hit_count, tuple(value.tolist())))
                sg_nodes(c, depth + len(c.key), out)
            return out

        theirs = sorted(sg_nodes(sg.root_node, 0, []))
        ours = sorted(
            (n.depth, n.klen, n.priority, n.hit_count, tuple(np.asarray(n.value).tolist())) for n in kv.nodes()
        )
        if theirs != ours:
            only_sg, only_kv = sorted(set(theirs) - set(ours))[:3], sorted(set(ours) - set(theirs))[:3]
            raise Mismatch(f"final trees differ: SGLang only {only_sg}, kvjax only {only_kv}")
        evict(1 << 30, "evict(everything)")
        step("alloc(everything)", sg_alloc.alloc(size), kv_alloc.alloc(size))
    except Mismatch as e:
        return n_ops[0], f"{e}\n  ops before it: " + " | ".join(trace[:-1][-TRACE_SHOWN:])
    except Exception as e:
        return n_ops[0], _crash(e, n_ops[0], trace)
    return n_ops[0], None


# ---------------------------------------------------------------------------------------------
# Host tier (HiCache): SGLang's UnifiedRadixCache with init_hicache's attachments replaced by
# CPU-only, synchronous stand-ins that move slot ids only.


def host_pool_tokens(device_tokens: int, ratio: float, page: int) -> int:
    """SGLang's host pool size for ``hicache_ratio``: ``(int(device * ratio) // page + 1) * page``."""
    return (int(device_tokens * ratio) // page + 1) * page


class _HostPoolStandIn:
    """SGLang's host KV pool as the tree uses it (``HostKVCache.alloc/free``, no buffers): the
    free list is handed out from its head, freed ids join its tail in the order freed (SGLang
    queues them and merges them lazily, which keeps that order). Allocations and frees are
    logged per op for the comparison."""

    shared_allocation_domain = None

    def __init__(self, size: int, page: int) -> None:
        self.size, self.page_size = size, page
        self.free_slots = list(range(size))
        self.log: list[tuple[str, list[int]]] = []

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int, **_: Any) -> Any:
        need = -(-need_size // self.page_size) * self.page_size
        if need > len(self.free_slots):
            return None
        got = self.free_slots[:need]
        del self.free_slots[:need]
        self.log.append(("alloc", got))
        return _sg().torch.tensor(got, dtype=_sg().torch.int64)

    def free(self, indices: Any) -> int:
        ids = _ids(indices) or []
        self.free_slots.extend(ids)
        if ids:
            self.log.append(("free", ids))
        return len(ids)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))

    def destroy(self) -> None:
        pass


class _HostGroupStandIn:
    """SGLang's ``HostPoolGroup`` with one pool (KV, the anchor) and no side pools."""

    def __init__(self, pool: _HostPoolStandIn) -> None:
        self.pool = pool
        self.anchor_entry = types.SimpleNamespace(host_pool=pool, host_evict_fn=None)
        self.entry_map: dict = {}
        self.entries: list = []
        self.page_size = pool.page_size

    def alloc(self, need_size: int, *, pool: Any = None, reclaim: Any = None, start_owner: Any = None) -> Any:
        got = self.pool.alloc(need_size)
        if got is None and reclaim is not None:
            reclaim(need_size)
            got = self.pool.alloc(need_size)
        return got

    def free(self, indices: Any, *, pool: Any = None) -> int:
        return self.pool.free(indices)

    def available_size(self, pool: Any = None) -> int:
        return self.pool.available_size()

    def get_pool(self, name: Any) -> Any:
        return None  # no SWA / Mamba host pools

    def resolve_host_transfers(self, transfers: Any, **_: Any) -> Any:
        return None

    def clear(self) -> None:
        self.pool.clear()

    def destroy(self) -> None:
        pass


class _Done:
    """A transfer's event that has completed (the copy is synchronous)."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class _ControllerStandIn:
    """What SGLang's tree asks of its ``HybridCacheController`` on the FULL host tier, with no
    threads and no bytes: ``write`` takes host slots (None when the host pool is short) and
    queues the backup, ``load`` takes device slots from the FULL allocator and queues the load;
    ``start_writing`` / ``start_loading`` (the scheduler's flush, once per step) turn the queue
    into one ack whose copy has already finished, so the next ``writing_check`` /
    ``loading_check`` completes it, as SGLang's polling does."""

    enable_storage = False
    pp_prefetch_command_group = None

    def __init__(self, group: _HostGroupStandIn, device_allocator: Any, write_policy: str) -> None:
        self.mem_pool_host = group
        self.mem_pool_device_allocator = device_allocator
        self.write_policy = write_policy
        self.write_queue: list[int] = []
        self.load_queue: list[int] = []
        self.ack_write_queue: list[Any] = []
        self.ack_load_queue: list[Any] = []

    @staticmethod
    def _ack(node_ids: list[int]) -> Any:
        return types.SimpleNamespace(
            start_event=_Done,
            finish_event=_Done,
            node_ids=node_ids,
            num_tokens_by_pool=None,
            num_bytes=0,
            timing_enabled=False,
        )

    def write(self, device_indices, priority=None, node_id=-1, extra_pools=None, flush=True, start_owner=None):
        host = self.mem_pool_host.alloc(len(device_indices))
        if host is None:
            return None
        self.write_queue.append(node_id)
        if flush:
            self.start_writing()
        return host

    def start_writing(self) -> None:
        if self.write_queue:
            self.ack_write_queue.append(self._ack(list(self.write_queue)))
            self.write_queue.clear()

    def load(
        self, host_indices, priority=None, node_id=-1, extra_pools=None, *, device_indices=None, anchor_indices=None
    ):
        torch = _sg().torch
        if host_indices.numel() == 0:
            device = torch.empty((0,), dtype=torch.int64)
        else:
            alloc = getattr(self.mem_pool_device_allocator, "full_attn_allocator", self.mem_pool_device_allocator)
            device = alloc.alloc(len(host_indices))
            if device is None:
                return None
        self.load_queue.append(node_id)
        return device

    def start_loading(self) -> int:
        if not self.load_queue:
            return -1
        self.ack_load_queue.append(self._ack(list(self.load_queue)))
        self.load_queue.clear()
        return 0

    def append_host_mem_release(self, host_indices=None, extra_pools=None) -> None:
        pass

    def reset(self) -> None:
        self.write_queue.clear()
        self.load_queue.clear()
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()


class _SgHiTree(_SgTree):
    """SGLang's FULL tree with its host tier attached as ``init_hicache`` attaches it (the
    controller and host pools replaced by the stand-ins above)."""

    def __init__(self, page: int, size: int, host_tokens: int, policy: str) -> None:
        super().__init__("full", page, size)
        self.kind = "hicache"
        t = self.tree
        self.host_pool = _HostPoolStandIn(host_tokens, page)
        group = _HostGroupStandIn(self.host_pool)
        t.host_pool_group = group
        t.cache_controller = _ControllerStandIn(group, self.alloc, policy)
        t.full_kv_pool_host = self.host_pool
        t.components[self.sg.ct.FULL]._full_kv_pool_host = self.host_pool
        t.tree_core.set_hicache_enabled()
        t.write_through_threshold = 1 if policy == "write_through" else 2
        t.is_write_back = policy == "write_back"
        t.load_back_threshold = 10
        t.enable_storage = False

    def match(self, key, ns):
        m = self.tree.match_prefix(self.sg.bp.MatchPrefixParams(key=self._key(key, ns)))
        node = m.last_device_node
        idx = _ids(self.tree.tree_core.collect_full_device_indices(node, self.tree.root_node_handle(ns)))
        n = int(m.device_prefix_len)
        out = (n, idx[:n], int(m.full_kv_hit_length), int(m.host_hit_length))
        return out, (node, m.best_match_node, int(m.host_hit_length))

    def lock(self, handle):
        return self.tree.lock(handle[0])

    def load_back(self, handle):
        """The scheduler's ``init_load_back`` after a match: load the host hit (if any) back."""
        dev_node, best, host_hit = handle
        t = self.tree
        if not (t.tree_core.is_full_device_evicted(best) or host_hit > 0):
            return 0, []
        if not t.load_back(best, None):
            return 0, []
        return len(got := _ids(t.tree_core.collect_full_device_indices(best, dev_node))), got

    def poll(self):
        t = self.tree
        t.flush_pending_backups()
        t.writing_check()
        t.ready_to_load_host_cache()
        t.loading_check()

    def evict_host(self, n):
        return int(self.tree.evict_host(n))

    def take_host_log(self):
        log, self.host_pool.log = self.host_pool.log, []
        return log

    def sizes(self):
        out = super().sizes()
        out["host_free"] = self.host_pool.available_size()
        return out


class _KvHiTree(_KvTree):
    """kvjax's ``HiRadixCache`` over its allocator; its host allocator logs allocations and
    frees per op, as the SGLang side's host pool does."""

    def __init__(self, page: int, size: int, host_tokens: int, policy: str) -> None:
        from kvjax.alloc import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from kvjax.radix import HiRadixCache

        self.kind, self.page = "full", page
        self.alloc = TokenToKVPoolAllocator(size) if page == 1 else PagedTokenToKVPoolAllocator(size, page)
        self.tree = HiRadixCache(
            page_size=page, host_pool_tokens=host_tokens, write_policy=policy, token_to_kv_pool_allocator=self.alloc
        )
        self.log: list[tuple[str, list[int]]] = []
        ha = self.tree.host_allocator
        inner_alloc, inner_free = ha.alloc, ha.free

        def alloc(n):
            got = inner_alloc(n)
            if got is not None:
                self.log.append(("alloc", _ids(got) or []))
            return got

        def free(ids):
            inner_free(ids)
            got = _ids(ids) or []
            if got:
                self.log.append(("free", got))

        ha.alloc, ha.free = alloc, free

    def match(self, key, ns):
        m = self.tree.match_prefix(list(key), extra_key=ns)
        n = int(m.prefix_len)
        out = (n, _ids(m.indices), int(m.full_kv_hit_length), int(getattr(m, "host_hit_length", 0)))
        return out, m

    def lock(self, m):
        return self.tree.inc_lock_ref(m.last_node)

    def load_back(self, m):
        before = m.prefix_len
        got = self.tree.init_load_back(m)
        if got is m:
            return 0, []
        return int(got.prefix_len) - before, _ids(got.indices)[before:]

    def poll(self):
        self.tree.check_transfers()

    def evict_host(self, n):
        return int(self.tree.evict_host(n))

    def take_host_log(self):
        log, self.log = self.log, []
        return log

    def sizes(self):
        out = super().sizes()
        out["host_free"] = int(self.tree.host_allocator.available_size())
        return out


def hicache_stream(page: int, device: int, ratio: float, policy: str, seed: int, ops: int) -> tuple[int, str | None]:
    """One random stream through both host-tier trees: admissions (match, load back the host hit,
    lock, allocate, finish by insert or retract), plain matches and held locks, device and host
    evictions, chunked checkpoints and the scheduler's polling step. After every op the results,
    sizes (device free, host free, FULL evictable/protected) and the host slots it allocated and
    freed must agree."""
    rng = random.Random(seed)
    size = device * page
    host = host_pool_tokens(size, ratio, page)
    pair = _TreePair(_SgHiTree(page, size, host, policy), _KvHiTree(page, size, host, policy))
    inner_step = pair.step

    def step(label, f, compare=lambda r: r):
        out = inner_step(label, f, compare)
        log_sg, log_kv = pair.sg.take_host_log(), pair.kv.take_host_log()
        if log_sg != log_kv:
            raise Mismatch(f"#{pair.n} {label}: host slots allocated/freed: SGLang {log_sg}, kvjax {log_kv}")
        return out

    pair.step = step  # type: ignore[method-assign]
    vocab = 3
    unit = max(page, 4)  # keys grow by whole pages, and past the load-back threshold at page 1
    prompts = [[rng.randrange(vocab) for _ in range(unit * rng.randrange(2, 6))] for _ in range(4)]
    live: list[dict] = []
    held: list[tuple] = []

    def key_of():
        base = rng.choice(prompts)[: unit * rng.randrange(0, 6)]
        tail = [rng.randrange(vocab) for _ in range(page * rng.randrange(0 if base else 1, 3 * unit // page))]
        return base + tail, rng.choice([None, None, None, "ns"])

    def admit():
        key, ns = key_of()
        show = f"key={_short(key)}, ns={ns}"
        (m, h_sg), (_, h_kv) = pair.step(f"match({show})", lambda s: s.match(key, ns), lambda r: r[0])
        hit, idx = m[0], m[1]
        if m[3] > 0:
            (loaded, ids), _ = pair.step("load_back(that match)", lambda s: s.load_back(pair.side(s, (h_sg, h_kv))))
            if loaded:
                (m, h_sg), (_, h_kv) = pair.step(
                    f"match({show}) after load", lambda s: s.match(key, ns), lambda r: r[0]
                )
                hit, idx = m[0], m[1]
        locks = pair.lock("lock(that match)", (h_sg, h_kv))
        new = pair.alloc_tokens(len(key) - hit)
        if new is None:
            pair.unlock("unlock(that lock)", locks)
            return
        live.append({"key": key, "ns": ns, "hit": hit, "values": idx + new, "locks": locks})

    def finish(req):
        key, ns, vals, hit = req["key"], req["ns"], req["values"], req["hit"]
        pair.step(
            f"insert(key={_short(key)}, ns={ns}, value={_short(vals)}, prev_prefix_len={hit})",
            lambda s: s.insert(key, ns, vals, hit),
        )
        pair.unlock("unlock(request)", req["locks"])

    def retract(req):
        pair.free_own_slots(req)
        pair.unlock("unlock(request)", req["locks"])

    def checkpoint(req):
        """A chunked-prefill checkpoint: insert the first pages, re-match them, move the lock."""
        part, ns, part_vals, hit, label = _checkpoint_cut(req, rng, page)
        pair.step(label, lambda s: s.insert(part, ns, part_vals, hit))
        (m, h_sg), (_, h_kv) = pair.step(
            f"match(key={_short(part)}, ns={ns})", lambda s: s.match(part, ns), lambda r: r[0]
        )
        new_locks = pair.lock("lock(that match)", (h_sg, h_kv))
        pair.unlock("unlock(request)", req["locks"])
        req["locks"], req["values"], req["hit"] = new_locks, m[1] + req["values"][m[0] :], m[0]

    def one_op():
        r = rng.random()
        ops = (admit, finish, retract, checkpoint)
        bounds = (0.3, 0.48, 0.53, 0.57, 0.62, 0.65)
        if _request_op(r, rng, pair, live, held, ops=ops, key_of=key_of, page=page, most=(4, 2), bounds=bounds):
            return
        if r < 0.75:
            full = rng.choice([page, 3 * page, 8 * page, 100])
            pair.step(f"evict({full})", lambda s: s.evict(full, 0))
        elif r < 0.82:
            n = rng.choice([page, 4 * page, 100])
            pair.step(f"evict_host({n})", lambda s: s.evict_host(n))
        else:
            pair.step("poll (writing_check, loading_check)", lambda s: s.poll(), lambda r: None)

    return pair.run(ops, one_op)


# ---------------------------------------------------------------------------------------------


def configurations(quick: bool) -> list[tuple[str, dict]]:
    """(name, arguments) of every configuration compared."""
    out: list[tuple[str, dict]] = []
    for page in (1, 4, 16):
        for need_sort in (False, True):
            out.append(
                (
                    f"alloc/page_{page}/need_sort_{int(need_sort)}",
                    {"kind": "alloc", "page": page, "need_sort": need_sort},
                )
            )
    for page in (1, 4, 16):
        out.append((f"full/page_{page}", {"kind": "full", "page": page}))
    for policy in EVICTION_POLICIES:
        for page in (1, 4, 16):
            out.append((f"full/{policy}/page_{page}", {"kind": "full", "page": page, "policy": policy}))
    for tree in ("radix", "unified"):
        for policy in EVICTION_POLICIES:
            for page in (1, 4, 16):
                out.append(
                    (
                        f"lifecycle/{tree}/{policy}/page_{page}",
                        {"kind": "lifecycle", "page": page, "policy": policy, "tree": tree},
                    )
                )
    for page in (1, 2, 4):
        for window in (4, 6, 8) if not quick else (4, 8):
            out.append((f"swa/page_{page}/window_{window}", {"kind": "swa", "page": page, "window": window}))
    for page in (1, 4):
        for max_states in (-1, 1, 2):
            out.append(
                (
                    f"mamba/page_{page}/max_states_{max_states}",
                    {"kind": "mamba", "page": page, "max_states": max_states},
                )
            )
    for policy in ("write_through", "write_through_selective", "write_back"):
        for ratio in (0.5, 2.0):
            for page in (1, 4):
                out.append(
                    (
                        f"hicache/{policy}/host_ratio_{ratio:g}/page_{page}",
                        {"kind": "hicache", "page": page, "policy": policy, "ratio": ratio},
                    )
                )
    return out


def run_config(args: dict, seed: int, ops: int) -> tuple[int, str | None]:
    if args["kind"] == "hicache":  # device: 64 tokens at page 1, 32 pages at page 4
        pages = 64 if args["page"] == 1 else 32
        return hicache_stream(args["page"], pages, args["ratio"], args["policy"], seed, ops)
    if args["kind"] == "alloc":
        return alloc_stream(args["page"], args["need_sort"], seed, ops)
    if args["kind"] == "lifecycle":
        return lifecycle_stream(args["policy"], args["page"], seed, ops, args.get("tree") == "unified")
    return tree_stream(
        args["kind"],
        args["page"],
        seed,
        ops,
        args.get("window", 0),
        args.get("max_states", -1),
        args.get("policy"),
    )


def compare(sglang_path: str, streams: int, ops: int, only: set[str] | None = None, seed: int = 0, quick=False) -> dict:
    """``{config: {"streams", "ops", "identical", "first_difference"}}`` over every configuration."""
    load_sglang(sglang_path)
    out: dict[str, dict] = {}
    for name, args in configurations(quick):
        if only and args["kind"] not in only:
            continue
        ran, same, first = 0, 0, None
        for s in range(streams):
            n, diff = run_config(args, seed * 1000 + s, ops)
            ran += n
            if diff is None:
                same += 1
            elif first is None:
                first = f"stream seed {seed * 1000 + s}: {diff}"
        entry: dict[str, Any] = {"streams": streams, "ops": ran, "identical": same}
        if first:
            entry["first_difference"] = first
        out[name] = entry
    return out


# Issue 35's case: three requests (priorities 2, 1, 0) with a one-page prompt and a decoded page
# each, their pages chosen through the free list; ``evict(12)`` under the priority policy at page 4.
_PRIORITY_CASE = (([1, 2, 3, 4], 2, 100, 99), ([5, 6, 7, 8], 1, 101, 15), ([9, 10, 11, 12], 0, 151, 131))


def priority_eviction_case() -> dict:
    """Both lifecycles (SGLang 0.5.23's ``RadixCache`` and kvjax's, page 4, 160-page pools, the
    ``priority`` policy) on :data:`_PRIORITY_CASE`: every page taken, then each request's prompt
    page and output page freed just before it allocates them, a checkpoint after every decoded
    token, a finish; then ``evict(12)`` and one ``alloc_extend`` of 12 tokens. Returns each
    side's evicted count and the slots handed out, and whether they differ."""
    from kvjax.radix import RadixCache
    from kvjax.req_pool import ReqToTokenPool
    from kvjax.request import Req

    sg_mod = _sg()
    torch, rc, bp = sg_mod.torch, sg_mod.rc, sg_mod.bp
    page, size, output = 4, 640, [20, 21, 22, 23]

    def slots(p: int) -> list[int]:
        return list(range(p * page, (p + 1) * page))

    a = _SgAlloc(size, page, False)
    a.alloc(int(a.a.available_size()))  # every page taken: the frees below pick them
    rows = _SgRows(4, 64)
    sg = rc.RadixCache(
        sg_mod.params(
            disable=False,
            req_to_token_pool=rows,
            token_to_kv_pool_allocator=a.a,
            page_size=page,
            eviction_policy="priority",
        )
    )
    for i, (prompt, priority, prompt_page, output_page) in enumerate(_PRIORITY_CASE):
        m = sg.match_prefix(bp.MatchPrefixParams(key=rc.RadixKey(array("q", prompt[:-1]))))
        s = types.SimpleNamespace(
            tokens=list(prompt),
            origin_input_ids=list(prompt),
            extra_key=None,
            cache_salt=None,
            priority=priority,
            kv=types.SimpleNamespace(req_pool_idx=i, cache_inserted_len=0, cache_protected_len=0, swa_evict_floor=0),
            lock=sg.lock(m.last_device_node),
            last_node=m.last_device_node,
        )
        a.free_segment(slots(prompt_page), 0)
        rows.req_to_token[i, :4] = torch.tensor(a.alloc_extend([0], [4], [-1]))
        s.full_untruncated_fill_ids = array("q", s.tokens)
        sg.checkpoint(s, up_to=4)
        a.free_segment(slots(output_page), 0)
        for n, tok in enumerate(output, start=4):
            rows.req_to_token[i, n] = a.alloc_extend([n], [n + 1], [int(rows.req_to_token[i, n - 1])])[0]
            s.tokens.append(tok)
            s.full_untruncated_fill_ids = array("q", s.tokens)
            sg.checkpoint(s, up_to=n + 1)
        sg.checkpoint(s, up_to=len(s.tokens))  # the finish (release_kv_cache with a checkpoint)
        start = s.kv.cache_protected_len
        a.free_segment(rows.req_to_token[i][start : len(s.tokens)].tolist(), start)
        sg.unlock(s.lock)
    theirs = (int(sg.evict(bp.EvictParams(num_tokens=12)).num_tokens_evicted), a.alloc_extend([0], [12], [-1]))

    k = _KvAlloc(size, page, False)
    k.alloc(int(k.a.available_size()))
    kv_rows = ReqToTokenPool(4, 64)
    kv = RadixCache(
        page_size=page, eviction_policy="priority", token_to_kv_pool_allocator=k.a, req_to_token_pool=kv_rows
    )
    for prompt, priority, prompt_page, output_page in _PRIORITY_CASE:
        got_rows = kv_rows.alloc(1)
        assert got_rows is not None
        row = int(got_rows[0])
        req = Req(f"p{priority}", list(prompt), req_pool_idx=row, priority=priority)
        kv.match_and_lock(req)
        k.free_segment(slots(prompt_page), 0)
        kv_rows.write(row, 0, np.asarray(k.alloc_extend([0], [4], [-1])))
        req.kv_committed_len = 4
        kv.cache_unfinished_req(req)
        k.free_segment(slots(output_page), 0)
        for n, tok in enumerate(output, start=4):
            kv_rows.req_to_token[row, n] = k.alloc_extend([n], [n + 1], [int(kv_rows.req_to_token[row, n - 1])])[0]
            req.output_ids.append(tok)
            req.kv_committed_len = n + 1
            kv.cache_unfinished_req(req)
        kv.cache_finished_req(req)
        kv_rows.free(row)
    ours = (int(kv.evict(12)), k.alloc_extend([0], [12], [-1]))
    res = [{"evict(12)": r[0], "alloc_extend(12) after": r[1]} for r in (theirs, ours)]
    return {"sglang": res[0], "kvjax": res[1], "differ": res[0] != res[1]}


def known_cases() -> dict[str, dict]:
    """The fixed cases of issues 19 and 35 the harness must tell apart (its self-test): for each, both
    results and whether they differ. Cases 3, 4 (SWA/Mamba recency) show in the random
    ``swa`` / ``mamba`` streams."""
    out: dict[str, dict] = {}

    # 1: a tree's paged free keeps row order (SGLang free_segment), only plain free() sorts.
    res = []
    for side in (_SgTree("full", 4, 64), _KvTree("full", 4, 64)):
        a, b = side.alloc_tokens(4), side.alloc_tokens(4)
        side.free_segment(a, 0)
        side.free_segment(b, 0)
        v = side.alloc_tokens(8)
        side.insert(list(range(8)), None, v, 0)
        side.evict(8, 0)
        res.append({"v": v, "alloc(4) after evict(8)": side.alloc_tokens(4)})
    out["1_tree_free_row_order"] = {"sglang": res[0], "kvjax": res[1], "differ": res[0] != res[1]}

    # 2: page-1 alloc_extend under need_sort (SGLang's scheduler: alloc(extend tokens)).
    res = []
    for alloc in (_SgAlloc(8, 1, True), _KvAlloc(8, 1, True)):
        x = alloc.alloc(4)
        alloc.free(x[:2])
        res.append(alloc.alloc_extend([0], [4], [-1]))
    out["2_page1_alloc_extend_need_sort"] = {"sglang": res[0], "kvjax": res[1], "differ": res[0] != res[1]}

    # 7: duplicates an insert frees span two nodes: SGLang frees them node by node (each page run
    # put at the head of the free list), as kvjax's lifecycle does.
    res = []
    for side in (_SgTree("full", 4, 64), _KvTree("full", 4, 64)):
        a = side.alloc_tokens(4)
        side.insert([0, 1, 2, 3], None, a, 0)
        b = side.alloc_tokens(4)
        side.insert(list(range(8)), None, a + b, 4)  # two nodes: tokens 0-3 and 4-7
        dup = side.alloc_tokens(8)
        side.insert(list(range(8)), None, dup, 0)  # all 8 already cached: dup freed
        res.append({"dup": dup, "alloc(4) after": side.alloc_tokens(4)})
    out["7_insert_duplicates_freed_per_node"] = {"sglang": res[0], "kvjax": res[1], "differ": res[0] != res[1]}

    # 8 (SWA, page 2): an insert whose walk frees a duplicate on a live node and then revives an
    # SWA tombstone below it (the request matched before another one revived the first node):
    # SGLang frees in walk order, node by node.
    res = []
    for side in (_SgTree("swa", 2, 32, window=4), _KvTree("swa", 2, 32, window=4)):
        a = side.alloc_tokens(8)
        side.insert([1, 0, 0, 1, 0, 0, 2, 1], None, a, 0)  # nodes [1,0,0,1] [0,0,2,1] (leaf cap)
        b = side.alloc_tokens(2, 2, a[1])
        side.insert([1, 0, 2, 2], None, a[:2] + b, 2)  # splits [1,0] | [0,1]
        evicted = side.evict(0, 6)
        v = side.alloc_tokens(6)
        got = side.insert([1, 0, 0, 1, 0, 1], None, v, 0)
        res.append(
            {
                "evict(0, 6)": evicted,
                "v": v,
                "insert": got[0],
                "alloc(2) x2": [side.alloc_tokens(2) for _ in range(2)],
            }
        )
    out["8_swa_duplicate_then_revival_free_order"] = {"sglang": res[0], "kvjax": res[1], "differ": res[0] != res[1]}

    # 9: an early SWA release of a lock without an SWA part (a match that ended at the root):
    # SGLang's release_swa_prefix_lock does nothing.
    res = []
    for side in (_SgTree("swa", 1, 64, window=4), _KvTree("swa", 1, 64, window=4)):
        _, node = side.match([1, 2], None)
        lock = side.lock(node)
        try:
            side.release_swa(lock)
            res.append("no-op")
        except Exception as e:  # a side that refuses it
            res.append(f"{type(e).__name__}: {e}")
    out["9_swa_release_of_root_lock"] = {"sglang": res[0], "kvjax": res[1], "differ": res[0] != res[1]}

    # 10 (host tier, page 1, device 64, host ratio 2, write_back): a loaded-back node's host copy
    # is a reclaimable duplicate once its load landed: evict_host frees all 12.
    res = []
    host = host_pool_tokens(64, 2, 1)
    for side in (_SgHiTree(1, 64, host, "write_back"), _KvHiTree(1, 64, host, "write_back")):
        key = list(range(1, 13))
        side.insert(key, None, side.alloc_tokens(12), 0)
        evicted = side.evict(100, 0)
        m, handle = side.match(key, None)
        loaded = side.load_back(handle)
        side.poll()
        res.append(
            {
                "evict(100)": evicted,
                "match": m,
                "load_back": loaded,
                "evict_host(100)": side.evict_host(100),
                "host slots": side.take_host_log(),
            }
        )
    out["10_hicache_write_back_loaded_copy_reclaimed"] = {"sglang": res[0], "kvjax": res[1], "differ": res[0] != res[1]}

    # 11 (host tier, page 1, device 32, host ratio 0.5, write_back): backing up an evicted leaf
    # reclaims the host copy of a device node first; the leaf's 8 tokens then hit on the host.
    res = []
    host = host_pool_tokens(32, 0.5, 1)
    for side in (_SgHiTree(1, 32, host, "write_back"), _KvHiTree(1, 32, host, "write_back")):
        key, other = list(range(1, 13)), list(range(20, 28))
        side.insert(key, None, side.alloc_tokens(12), 0)
        side.evict(100, 0)
        side.insert(other, None, side.alloc_tokens(8), 0)
        side.insert(key, None, side.alloc_tokens(12), 0)
        evicted = side.evict(8, 0)
        res.append(
            {
                "evict(8)": evicted,
                "host free": side.sizes()["host_free"],
                "match(20..27)": side.match(other, None)[0],
                "host slots": side.take_host_log(),
            }
        )
    out["11_hicache_write_back_duplicate_reclaimed_for_backup"] = {
        "sglang": res[0],
        "kvjax": res[1],
        "differ": res[0] != res[1],
    }

    # 12 (issue 35, page 4, priority policy): a priority eviction frees leaf by leaf in eviction
    # order, each leaf's pages in row order; the next alloc_extend hands them out from the last.
    out["12_priority_eviction_free_order"] = priority_eviction_case()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sglang-path", required=True, help="folder holding the 'sglang' package")
    ap.add_argument("--streams", type=int, default=3, help="random streams per configuration")
    ap.add_argument("--ops", type=int, default=2000, help="ops per stream")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="comma-separated kinds: alloc, full, swa, mamba, hicache")
    ap.add_argument("--quick", action="store_true", help="1 stream of 300 ops, fewer windows")
    ap.add_argument(
        "--sorted-frees",
        action="store_true",
        help="SGLang's free_segment as its sorted free (hides known difference 1 to show the others)",
    )
    ap.add_argument("--self-test", action="store_true", help="only the fixed cases of issue 19")
    args = ap.parse_args(argv)
    if args.self_test:
        load_sglang(args.sglang_path)
        print(json.dumps({"benchmark": "known_cases_vs_sglang", "cases": known_cases()}, indent=2))
        return
    global SORTED_FREES
    SORTED_FREES = args.sorted_frees
    streams, ops = (1, 300) if args.quick else (args.streams, args.ops)
    t0 = time.time()
    only = set(args.only.split(",")) if args.only else None
    checks = compare(args.sglang_path, streams, ops, only, args.seed, args.quick)
    print(
        json.dumps(
            {
                "benchmark": "allocators_and_trees_vs_sglang",
                "streams_per_config": streams,
                "ops_per_stream": ops,
                "all_identical": all(e["identical"] == e["streams"] for e in checks.values()),
                "seconds": round(time.time() - t0, 1),
                "checks": checks,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
