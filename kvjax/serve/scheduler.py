"""A continuous-batching loop in the shape of SGLang's scheduler, on kvjax's public API only.

Each ``step()`` runs one batch:

* **prefill** when a chunked request is in flight or requests are waiting: the chunked request
  continues first, then waiting requests are admitted in arrival order while the token budget
  (``chunked_prefill_size``), the request rows and the pool allow. Admission is
  ``match_and_lock`` (match the prefix, lock it); memory is *evict, then allocate*
  (``tree.evict`` of what is missing, then one vectorised ``alloc_extend`` for the batch). The
  last admitted request may be cut to the budget: it becomes the chunked request and is cached
  with ``cache_unfinished_req`` after its chunk. A request whose prompt is done samples its first
  token, is cached with ``cache_unfinished_req`` (so later requests can share its prompt) and
  joins the decode batch;
* **decode** otherwise: one token for every running request via ``alloc_decode``, again after
  evicting what is missing. When even eviction cannot make room, requests are **retracted** (the
  most recently admitted first): their KV is released (``cache_finished_req(is_insert=False)``),
  their row freed, and they go back to the front of the queue with the tokens they generated,
  to be re-prefilled later.

A request finishes after ``max_new_tokens`` tokens; ``cache_finished_req`` inserts its prompt and
output into the tree and releases its lock, and its row is freed.

The step function is jitted with the pools donated; the host reads back only the sampled tokens.
Invariant after every step: ``allocator.available_size() + tree.evictable_size() +
tree.protected_size() + tokens held by running requests outside the tree == allocator.size``;
with no request left, the last term is 0 (``leak_free``).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from kvjax.build import KVCache
from kvjax.request import Req
from kvjax.serve.step import make_step, pack_batch
from kvjax.spec import ModelSpec


class ServingReq(Req):
    """A request of the serving loop: a ``Req`` plus its generation limit and bookkeeping."""

    __slots__ = ("max_new_tokens", "admitted_at", "first_cached_tokens", "retracted")

    def __init__(self, rid: Any, prompt: Sequence[int], *, max_new_tokens: int, extra_key: Any = None) -> None:
        if max_new_tokens <= 0:
            raise ValueError(f"request {rid!r}: max_new_tokens={max_new_tokens} must be positive")
        if len(prompt) == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty; give at least one token")
        super().__init__(rid, list(prompt), extra_key=extra_key)
        self.max_new_tokens = int(max_new_tokens)
        self.admitted_at = -1
        self.first_cached_tokens: int | None = None
        self.retracted = 0

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens


@dataclasses.dataclass
class ServeStats:
    """Counters of one run. Tokens are counts over all requests; seconds are wall time of steps."""

    requests_finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens_computed: int = 0
    generated_tokens: int = 0
    evicted_tokens: int = 0
    retractions: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    step_seconds: float = 0.0
    peak_used_tokens: int = 0
    occupancy: list[float] = dataclasses.field(default_factory=list)
    hit_rate_history: list[float] = dataclasses.field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler:
    """Runs requests to completion on a built ``KVCache`` and a model's weights.

    Args:
        spec: the model (its layers must match the cache's pool).
        cache: a built cache; its ``tree_cache`` decides whether prefixes are shared.
        params: the model's weights (``kvjax.serve.model.init_params``).
        max_batch_size: sequence rows per step (the step is compiled for this many).
        chunked_prefill_size: prefill token budget per step (default: the plan's, else 2048).
    """

    def __init__(
        self,
        spec: ModelSpec,
        cache: KVCache,
        params: dict,
        *,
        max_batch_size: int = 16,
        chunked_prefill_size: int | None = None,
    ) -> None:
        if cache.tree_cache is None:
            raise ValueError("the cache has no tree cache: build it with build_kv_cache")
        self.spec = spec
        self.cache = cache
        self.params = params
        self.tree = cache.tree_cache
        self.alloc = cache.allocator
        self.rows = cache.req_to_token_pool
        self.pools = cache.pools
        self.page_size = self.alloc.page_size
        self.max_batch_size = min(max_batch_size, self.rows.size)
        self.budget = chunked_prefill_size or cache.plan.chunked_prefill_size or 2048
        self.pages_per_seq = -(-self.rows.max_context_len // self.page_size)
        self.step_fn = make_step(spec)
        self.waiting: collections.deque[ServingReq] = collections.deque()
        self.running: list[ServingReq] = []
        self.chunked: ServingReq | None = None
        self.finished: list[ServingReq] = []
        self.stats = ServeStats()
        self._admissions = 0

    # --- public ---------------------------------------------------------------------------------

    def submit(self, reqs: Iterable[ServingReq]) -> None:
        """Queue requests (arrival order is admission order)."""
        for req in reqs:
            if req.seqlen() + req.max_new_tokens > self.rows.max_context_len:
                raise ValueError(
                    f"request {req.rid!r}: {req.seqlen()} prompt + {req.max_new_tokens} new tokens exceed the "
                    f"context of {self.rows.max_context_len - 4} tokens; shorten it or raise context_length"
                )
            self.stats.prompt_tokens += req.seqlen()
            self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked)

    def step(self) -> list[ServingReq]:
        """Run one batch; return the requests that finished in it."""
        done: list[ServingReq] = []
        ran = False
        if self.chunked is not None or self.waiting:
            ran = self._prefill(done)
        if not ran and self.running:
            self._decode(done)
            ran = True
        if not ran and (self.waiting or self.chunked):
            raise RuntimeError(
                f"no progress: {len(self.waiting)} waiting requests fit neither the pool ({self.alloc.size} tokens) "
                f"nor the request table ({self.rows.size} rows); raise max_total_tokens"
            )
        used = self.alloc.size - self.alloc.available_size() - self.tree.evictable_size()
        self.stats.peak_used_tokens = max(self.stats.peak_used_tokens, used)
        self.stats.occupancy.append((self.alloc.size - self.alloc.available_size()) / self.alloc.size)
        self.stats.hit_rate_history.append(self.stats.hit_rate)
        self.finished.extend(done)
        return done

    def run(self, reqs: Iterable[ServingReq] = ()) -> list[ServingReq]:
        """Submit ``reqs`` and step until every request has finished; return them in finishing order."""
        self.submit(reqs)
        while not self.idle:
            self.step()
        return self.finished

    def leak_free(self) -> bool:
        """With no request left: ``available + evictable + protected == capacity`` and every row free."""
        accounted = self.alloc.available_size() + self.tree.evictable_size() + self.tree.protected_size()
        return self.idle and accounted == self.alloc.size and self.rows.available_size() == self.rows.size

    # --- memory -----------------------------------------------------------------------------------

    def _make_room(self, tokens: int) -> bool:
        """Evict until ``tokens`` slots are free; True when they are."""
        missing = tokens - self.alloc.available_size()
        if missing > 0:
            self.stats.evicted_tokens += self.tree.evict(missing)
        return self.alloc.available_size() >= tokens

    def _pages_needed(self, prefix_len: int, seq_len: int) -> int:
        ps = self.page_size
        return (-(-seq_len // ps) - -(-prefix_len // ps)) * ps

    # --- prefill ----------------------------------------------------------------------------------

    def _prefill(self, done: list[ServingReq]) -> bool:
        batch: list[tuple[ServingReq, int, int]] = []  # (req, prefix_len, seq_len after this chunk)
        budget = self.budget
        need = 0
        if self.chunked is not None:
            req = self.chunked
            start = req.kv_len()
            end = min(req.seqlen(), start + budget)
            batch.append((req, start, end))
            need += self._pages_needed(start, end)
            self.chunked = None
            if not self._make_room(need):
                self._retract(req)
                return False
            budget -= end - start
        while self.waiting and budget > 0 and len(batch) + len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            rows = self.rows.alloc(1)
            if rows is None:
                break
            req.req_pool_idx = rows[0]
            req.kv_committed_len = None
            start = self._match_and_lock(req)
            end = min(req.seqlen(), start + budget)
            extra = self._pages_needed(start, end)
            if not self._make_room(need + extra):
                self._unadmit(req)
                break
            self.waiting.popleft()
            if req.first_cached_tokens is None:
                req.first_cached_tokens = start
                self.stats.cached_tokens += start
            req.admitted_at = self._admissions
            self._admissions += 1
            batch.append((req, start, end))
            budget -= end - start
            need += extra
        if not batch:
            return False

        prefix = np.array([s for _, s, _ in batch])
        seq = np.array([e for _, _, e in batch])
        last = np.array([self.rows.req_to_token[r.req_pool_idx, s - 1] if s else -1 for r, s, _ in batch])
        slots = self.alloc.alloc_extend(prefix, seq, last)
        if slots is None:  # _make_room guaranteed the pages; this is a bookkeeping bug
            raise RuntimeError(f"alloc_extend failed with {self.alloc.available_size()} free tokens for {need}")
        offsets = np.concatenate([[0], np.cumsum(seq - prefix)])
        for i, (req, s, e) in enumerate(batch):
            self.rows.write(req.req_pool_idx, s, slots[offsets[i] : offsets[i + 1]])
        tokens = [np.asarray(req.token_range(s, e), np.int32) for req, s, e in batch]
        next_tokens = self._forward(tokens, list(prefix), slots, [r.req_pool_idx for r, _, _ in batch], seq)
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens_computed += int((seq - prefix).sum())

        for (req, _, end), token in zip(batch, next_tokens):
            req.kv_committed_len = int(end)
            if end < req.seqlen():
                self.tree.cache_unfinished_req(req)
                self.chunked = req
                continue
            self._append_token(req, int(token), done)
        return True

    def _match_and_lock(self, req: ServingReq) -> int:
        """Match the request's tokens (all but the last: one must be computed), lock the prefix,
        record it on the request; return the prefix length."""
        n = req.seqlen() - 1
        match = self.tree.match_prefix(req.token_range(0, n) if n > 0 else [], req.extra_key)
        req.prefix_indices = match.indices
        req.last_node = match.last_node
        req.lock_receipt = self.tree.inc_lock_ref(match.last_node)
        req.cache_protected_len = len(match.indices)
        if len(match.indices):
            self.rows.write(req.req_pool_idx, 0, match.indices)
        return len(match.indices)

    def _unadmit(self, req: ServingReq) -> None:
        """Undo an admission that found no memory: unlock, free the row, leave it queued."""
        self.tree.dec_lock_ref(req.lock_receipt if req.lock_receipt is not None else req.last_node)
        self._reset(req)

    def _reset(self, req: ServingReq) -> None:
        self.rows.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.lock_receipt = None
        req.cache_protected_len = 0
        req.prefix_indices = np.empty(0, np.int32)
        req.kv_committed_len = None

    # --- decode -----------------------------------------------------------------------------------

    def _decode(self, done: list[ServingReq]) -> None:
        while True:
            kv_len = np.array([r.kv_len() for r in self.running])
            need = int(((kv_len % self.page_size) == 0).sum()) * self.page_size
            if self._make_room(need):
                break
            self._retract(self.running.pop(int(np.argmax([r.admitted_at for r in self.running]))))
            if not self.running:
                return
        rows = [r.req_pool_idx for r in self.running]
        last = self.rows.req_to_token[rows, kv_len - 1]
        slots = self.alloc.alloc_decode(kv_len + 1, last)
        if slots is None:
            raise RuntimeError(f"alloc_decode failed with {self.alloc.available_size()} free tokens for {need}")
        for req, n, slot in zip(self.running, kv_len, slots):
            self.rows.write(req.req_pool_idx, int(n), slot.reshape(1))
        tokens = [np.asarray([r.output_ids[-1]], np.int32) for r in self.running]
        next_tokens = self._forward(tokens, list(kv_len), slots, rows, kv_len + 1)
        self.stats.decode_steps += 1
        running, self.running = self.running, []
        for req, n, token in zip(running, kv_len, next_tokens):
            req.kv_committed_len = int(n) + 1
            self._append_token(req, int(token), done)

    def _retract(self, req: ServingReq) -> None:
        """Release a running request's KV and requeue it (with its output) at the front."""
        self.tree.cache_finished_req(req, is_insert=False)
        self._reset(req)
        req.retracted += 1
        self.stats.retractions += 1
        self.waiting.appendleft(req)

    # --- shared -----------------------------------------------------------------------------------

    def _append_token(self, req: ServingReq, token: int, done: list[ServingReq]) -> None:
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        if req.done:
            self.tree.cache_finished_req(req)
            self.rows.free(req.req_pool_idx)
            req.req_pool_idx = None
            req.finished = True
            self.stats.requests_finished += 1
            done.append(req)
        else:
            self.tree.cache_unfinished_req(req, chunked=False)
            self.running.append(req)

    def _forward(
        self, tokens: list[np.ndarray], starts: list[int], slots: np.ndarray, rows: list[int], seq_lens: np.ndarray
    ) -> np.ndarray:
        table = self.rows.page_table_numpy(rows, seq_lens, self.page_size, self.pages_per_seq)
        flat, meta = pack_batch(
            tokens=tokens, starts=starts, slots=slots, page_table=table, max_seqs=self.max_batch_size
        )
        start = time.perf_counter()
        self.pools, next_tokens = self.step_fn(self.pools, self.params, flat, meta)
        out = np.asarray(jax.device_get(next_tokens))[: len(tokens)]
        self.stats.step_seconds += time.perf_counter() - start
        return out
