"""`OwnLoop`: admission, prefill, decode and release for a serving loop of your own.

kvjax's ``Scheduler`` runs the whole loop. A loop of your own (your batching, your sampling,
your jitted step) needs only the cache's bookkeeping, and this object does all of it without
SGLang's request fields: each request is a :class:`LoopRequest` handle, and the life of one is

=====================  ==========================================================================
call                   what it does
=====================  ==========================================================================
``admit(prompt)``      matches the longest cached prefix (all but the last prompt token: at least
                       one is computed), locks it, takes a request-table row; ``req.reused``
                       tokens come from the tree
``prepare(reqs)``      the next tokens of each request (its uncomputed prompt, in chunks of at most
                       ``max_tokens``, or its appended tokens): slots allocated (evicting the
                       tree's unlocked prefixes when the pool is short), written to the row, and
                       the step's ``(tokens, meta)`` built and validated on the host
``commit(batch, p)``   the step ran: its tokens' K/V is in the pools ``p`` it returned, which are
                       handed to the cache (``cache.pools`` stays current); a prompt computed to
                       its end is shared in the tree at once, as the scheduler does
``discard(batch)``     the step did not run: its slots go back, the requests are as before
``append(req, ids)``   sampled tokens, computed by the next ``prepare`` (decode)
``finish(req)``        the computed tokens join the tree; the lock and the row are released
``abort(req)``         the request's own slots are freed and nothing is inserted
=====================  ==========================================================================

Invariants after every call (``check``): a slot has one owner (the tree, or one request for the
slots past its cached prefix), every slot is free, the tree's or a live request's, and a
rejected call changes nothing. Slots and rows are the allocator's and the request table's: the
loop never clamps an id, and the metadata it builds is validated (``MetadataBuilder.for_cache``).

Caches whose kinds need the scheduler's serving hooks (sliding-window pools, recurrent state, the
host tier) are refused at construction, naming the kinds: they need per-step metadata parts or
per-request state that ``Scheduler`` drives.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import numpy as np

from kvjax.attention.metadata import AttentionMetadata
from kvjax.attention.metadata_builder import MetadataBuilder
from kvjax.build import KVCache
from kvjax.errors import InvalidSlotError, OutOfMemoryError
from kvjax.request import Req

__all__ = ["LoopBatch", "LoopRequest", "OwnLoop"]


@dataclass(eq=False)
class LoopRequest:
    """One request of an :class:`OwnLoop` (a handle: read its fields, change it only through the loop).

    Attributes:
        rid: the id given to ``admit`` (or a counter).
        tokens: the prompt followed by every appended token.
        prompt_len: tokens of the prompt.
        reused: prompt tokens whose K/V came from the tree at admission.
        computed: tokens whose K/V is in the pools (committed steps).
        row: the request-table row (slot of token ``i`` at ``req_to_token[row, i]``).
        state: ``"running"``, ``"finished"`` or ``"aborted"``.
    """

    rid: Hashable
    tokens: list[int]
    prompt_len: int
    reused: int
    computed: int
    row: int
    state: str = "running"
    _req: Req = field(repr=False, default=None)  # type: ignore[assignment]
    _batch: LoopBatch | None = field(repr=False, default=None)

    @property
    def pending(self) -> int:
        """Tokens not computed yet (the next ``prepare`` computes them, up to its budget)."""
        return len(self.tokens) - self.computed


@dataclass(eq=False)
class LoopBatch:
    """One prepared step: pass ``tokens`` and ``meta`` to your jitted step, then ``commit`` (or
    ``discard``) it.

    Attributes:
        tokens: int32 ``[T]``, padded to a power of two (padding tokens write to the trash page;
            their output rows are not read: take logits at ``meta.logits_indices``).
        meta: the step's ``AttentionMetadata`` (numpy leaves; fixed shapes per ``T``).
        requests: the batch's requests, in row order of ``meta`` (row ``i``'s last token's
            logits are at ``meta.logits_indices[i]``).
        starts / ends: each request's computed length before and after this step.
        slots: int32 slots of the new tokens, concatenated in request order.
    """

    tokens: np.ndarray
    meta: AttentionMetadata
    requests: tuple[LoopRequest, ...]
    starts: np.ndarray
    ends: np.ndarray
    slots: np.ndarray
    open: bool = True


class OwnLoop:
    """The cache's bookkeeping for a loop of your own (module docstring).

    Args:
        cache: a built ``KVCache`` (full-attention or MLA pools; see the module docstring).
        max_seqs: requests per step (the metadata's padded row count: one compiled shape).
        max_tokens: per ``prepare``, the most tokens a request computes (chunked prefill);
            None: its whole pending part.

    Raises:
        NotImplementedError: the cache's kinds need the scheduler's serving hooks (named).
    """

    def __init__(self, cache: KVCache, *, max_seqs: int, max_tokens: int | None = None) -> None:
        from kvjax.serve.kinds import default_extensions

        hooks = default_extensions(cache)
        if hooks:
            names = ", ".join(type(h).__name__ for h in hooks)
            raise NotImplementedError(
                f"this cache's kinds need the scheduler's serving hooks ({names}): per-step metadata parts or "
                "per-request state; serve it with kvjax.serve.scheduler.Scheduler (your model through "
                "make_module_step), or build a full-attention or MLA cache for your own loop"
            )
        if max_seqs < 1:
            raise ValueError(f"max_seqs={max_seqs}: give at least 1 request per step")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: give at least 1 token per request and step, or None")
        self.cache = cache
        self.max_seqs = int(max_seqs)
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self.builder = MetadataBuilder.for_cache(cache, self.max_seqs)
        self.requests: list[LoopRequest] = []  # live, in admission order
        self._ids = count()

    # --- the host objects ---------------------------------------------------------------------

    @property
    def tree(self) -> Any:
        return self.cache.tree_cache

    @property
    def allocator(self) -> Any:
        return self.cache.token_to_kv_pool_allocator

    @property
    def rows(self) -> Any:
        return self.cache.req_to_token_pool

    # --- lifecycle ------------------------------------------------------------------------------

    def admit(self, prompt: Sequence[int], *, rid: Hashable = None, extra_key: Hashable = None) -> LoopRequest:
        """Start a request: its cached prefix matched and locked, a row taken (module docstring).

        Raises (nothing changed): ``ValueError`` for an empty or non-integer prompt, or one longer
        than a row; ``OutOfMemoryError`` when every request-table row is in use.
        """
        ids = _token_ids(prompt, "prompt")
        width = int(self.rows.req_to_token.shape[1])
        if len(ids) > width:
            raise ValueError(f"prompt of {len(ids)} tokens; a request-table row holds {width} (context_length)")
        rows = self.rows.alloc(1)
        if rows is None:
            raise OutOfMemoryError(
                f"no free request-table row ({len(self.requests)} requests live): finish or abort one first"
            )
        row = int(rows[0])
        req = Req(next(self._ids) if rid is None else rid, list(ids), extra_key=extra_key)
        match = self.tree.match_prefix(ids[:-1], extra_key) if len(ids) > 1 else self.tree.match_prefix([], extra_key)
        reused = len(match.indices)
        req.req_pool_idx = row
        req.prefix_indices = match.indices
        req.last_node = match.last_node
        req.lock_receipt = self.tree.inc_lock_ref(match.last_node)
        req.cache_protected_len = reused
        req.kv_committed_len = reused
        req.cached_tokens = reused
        if reused:
            self.rows.write(row, 0, match.indices)
        handle = LoopRequest(req.rid, list(ids), len(ids), reused, reused, row, _req=req)
        self.requests.append(handle)
        return handle

    def append(self, req: LoopRequest, token_ids: int | Sequence[int]) -> None:
        """Add sampled tokens to ``req``; the next ``prepare`` computes them. Raises ``ValueError``
        (nothing added) for a request not running, non-integer ids, or a row too short."""
        self._require_running(req, "append")
        ids = _token_ids([token_ids] if isinstance(token_ids, (int, np.integer)) else token_ids, "token_ids")
        width = int(self.rows.req_to_token.shape[1])
        if len(req.tokens) + len(ids) > width:
            raise ValueError(
                f"request {req.rid!r} would hold {len(req.tokens) + len(ids)} tokens; a row holds {width} "
                "(context_length): finish it"
            )
        req.tokens.extend(ids)
        req._req.output_ids.extend(ids)

    def prepare(self, requests: Sequence[LoopRequest], *, max_tokens: int | None = None) -> LoopBatch:
        """Slots and metadata for the next tokens of ``requests`` (module docstring).

        ``max_tokens`` overrides the loop's per-request budget for this step.

        Raises (nothing changed): ``ValueError`` for more than ``max_seqs`` requests, one listed
        twice, not running, already in an open batch, or with nothing to compute;
        ``OutOfMemoryError`` when the pool has too few free slots even after evicting every
        unlocked cached prefix.
        """
        reqs = tuple(requests)
        if not reqs:
            raise ValueError("prepare: give at least one request")
        if len(reqs) > self.max_seqs:
            raise ValueError(f"prepare: {len(reqs)} requests; this loop's steps take at most max_seqs={self.max_seqs}")
        if len({id(r) for r in reqs}) != len(reqs):
            raise ValueError("prepare: a request is listed twice")
        budget = self.max_tokens if max_tokens is None else int(max_tokens)
        if budget is not None and budget < 1:
            raise ValueError(f"prepare: max_tokens={budget}; give at least 1")
        for r in reqs:
            self._require_running(r, "prepare")
            if r._batch is not None:
                raise ValueError(f"prepare: request {r.rid!r} is in a batch not committed yet: commit or discard it")
            if r.pending == 0:
                raise ValueError(f"prepare: request {r.rid!r} has nothing to compute: append its sampled token first")
        starts = np.array([r.computed for r in reqs], np.int64)
        ends = np.array([r.computed + (r.pending if budget is None else min(r.pending, budget)) for r in reqs])
        table = self.rows.req_to_token
        last = np.array([table[r.row, s - 1] if s else -1 for r, s in zip(reqs, starts.tolist(), strict=True)])
        slots = self._alloc(starts, ends, last)
        offsets = np.concatenate([[0], np.cumsum(ends - starts)])
        for i, r in enumerate(reqs):
            self.rows.write(r.row, int(starts[i]), slots[offsets[i] : offsets[i + 1]])
        tokens = [
            np.asarray(r.tokens[s:e], np.int32) for r, s, e in zip(reqs, starts.tolist(), ends.tolist(), strict=True)
        ]
        try:
            step_tokens, meta = self.builder.build(
                tokens=tokens, starts=starts, slots=slots, rows=np.array([r.row for r in reqs]), seq_lens=ends
            )
        except BaseException:
            self._free_new_pages(starts, ends, slots)
            raise
        batch = LoopBatch(step_tokens, meta, reqs, starts, ends, slots)
        for r in reqs:
            r._batch = batch
        return batch

    def commit(self, batch: LoopBatch, pools: Any) -> None:
        """The step of ``batch`` ran and returned ``pools``: hand them to the cache (``cache.pools``
        is current again) and advance each request. A prompt computed to its end is inserted in
        the tree (shared with later requests); a partial prompt is cached as a chunk."""
        self._require_open(batch, "commit")
        self.cache.set_pools(pools)
        batch.open = False
        for r, start, end in zip(batch.requests, batch.starts.tolist(), batch.ends.tolist(), strict=True):
            r._batch = None
            r.computed = int(end)
            req = r._req
            req.kv_committed_len = r.computed
            if r.computed < r.prompt_len:
                self.tree.cache_unfinished_req(req, chunked=True)
            elif start < r.prompt_len:
                self.tree.cache_unfinished_req(req)  # the prompt is computed: share it now

    def discard(self, batch: LoopBatch) -> None:
        """``batch``'s step did not run: its slots go back to the allocator; the requests are as
        before ``prepare``."""
        self._require_open(batch, "discard")
        batch.open = False
        self._free_new_pages(batch.starts, batch.ends, batch.slots)
        for r in batch.requests:
            r._batch = None

    def finish(self, req: LoopRequest) -> None:
        """Cache ``req``'s computed tokens in the tree and release its lock and row (its slots
        past the tree's become the tree's, or are freed where the tree has them already)."""
        self._release(req, "finish", insert=True)
        req.state = "finished"

    def abort(self, req: LoopRequest) -> None:
        """Release ``req`` without caching: its own slots are freed, its lock and row released."""
        self._release(req, "abort", insert=False)
        req.state = "aborted"

    # --- checks ---------------------------------------------------------------------------------

    def owners(self) -> dict[int, str]:
        """Every slot in use and its one owner (``"tree"`` or a request's ``rid``), O(pool).

        Raises ``InvalidSlotError`` naming a slot with two owners (the tree and a request's own
        part, or two requests)."""
        owner: dict[int, str] = {}

        def claim(slots: np.ndarray, who: str) -> None:
            for s in np.asarray(slots).tolist():
                if s in owner:
                    raise InvalidSlotError(f"slot {s} has two owners: {owner[s]} and {who}")
                owner[s] = who

        claim(_tree_slots(self.tree), "tree")
        table = self.rows.req_to_token
        for r in self.requests:
            own_from = r._req.cache_protected_len
            claim(table[r.row, own_from : r.computed], f"request {r.rid!r}")
            if r._batch is not None:
                i = r._batch.requests.index(r)
                prepared = table[r.row, int(r._batch.starts[i]) : int(r._batch.ends[i])]
                claim(prepared, f"request {r.rid!r} (prepared)")
        return owner

    def leak_free(self) -> bool:
        """Every slot is free or owned (``owners``): allocated slots equal the owned ones."""
        alloc = self.allocator
        ps = int(alloc.page_size)
        owned_pages = {s // ps for s in self.owners()}  # a request's last page may be partly owned
        return alloc.size - alloc.available_size() == len(owned_pages) * ps

    # --- internals ------------------------------------------------------------------------------

    def _alloc(self, starts: np.ndarray, ends: np.ndarray, last: np.ndarray) -> np.ndarray:
        alloc = self.allocator
        slots = alloc.alloc_extend(starts, ends, last)
        if slots is None:
            ps = int(alloc.page_size)
            need = int(sum(-(-int(e) // ps) - -(-int(s) // ps) for s, e in zip(starts, ends, strict=True))) * ps
            self.tree.evict(max(need - alloc.available_size(), 1))
            slots = alloc.alloc_extend(starts, ends, last)
        if slots is None:
            raise OutOfMemoryError(
                f"{int((ends - starts).sum())} new tokens do not fit: {alloc.available_size()} slots free and nothing "
                "left to evict; finish or abort requests, or prepare fewer tokens"
            )
        return np.asarray(slots, np.int32)

    def _free_new_pages(self, starts: np.ndarray, ends: np.ndarray, slots: np.ndarray) -> None:
        """Free the slots a ``prepare`` allocated: every new page, but not the slots that continue
        a request's last partial page (that page stays the request's)."""
        ps = int(self.allocator.page_size)
        keep = np.zeros(slots.size, bool)
        offset = 0
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            on_old_page = min((-start) % ps, end - start)
            keep[offset : offset + on_old_page] = True
            offset += end - start
        fresh = slots[~keep]
        if fresh.size:
            self.allocator.free(fresh)

    def _release(self, req: LoopRequest, what: str, *, insert: bool) -> None:
        self._require_running(req, what)
        if req._batch is not None:
            raise ValueError(f"{what}: request {req.rid!r} is in a batch not committed yet: commit or discard it")
        r = req._req
        r.kv_committed_len = req.computed
        r.finished = True
        if insert:
            self.tree.cache_finished_req(r)
        else:
            self.tree.cache_finished_req(r, is_insert=False)
        self.rows.free(req.row)
        self.requests.remove(req)

    def _require_running(self, req: LoopRequest, what: str) -> None:
        if not isinstance(req, LoopRequest):
            raise TypeError(f"{what}: expected a LoopRequest from OwnLoop.admit, got {type(req).__name__}")
        if req.state != "running" or all(r is not req for r in self.requests):
            raise ValueError(f"{what}: request {req.rid!r} is {req.state} (not a running request of this loop)")

    def _require_open(self, batch: LoopBatch, what: str) -> None:
        if not isinstance(batch, LoopBatch):
            raise TypeError(f"{what}: expected a LoopBatch from OwnLoop.prepare, got {type(batch).__name__}")
        if not batch.open:
            raise ValueError(f"{what}: this batch was committed or discarded already")


def _token_ids(ids: Any, what: str) -> list[int]:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D sequence of token ids, got shape {list(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    if (arr < 0).any():
        raise ValueError(f"{what} holds negative token ids: {arr[arr < 0][:8].tolist()}")
    return [int(t) for t in arr.tolist()]


def _tree_slots(tree: Any) -> np.ndarray:
    """Every device slot the tree's nodes hold (concatenated)."""
    values = [n.value for n in tree.nodes() if n.value is not None and n.value.size]
    return np.concatenate(values) if values else np.zeros(0, np.int32)
