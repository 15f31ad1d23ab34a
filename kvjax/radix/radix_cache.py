"""`RadixCache`: the full-KV prefix cache (SGLang's ``RadixCache`` contract) on the tree core.

Use it standalone for simulation (``RadixCache(page_size=16)``; ``insert(tokens)`` then
synthesizes slot ids) or with the request pool and allocator of a serving loop.

Request lifecycle (SGLang semantics, see ``cache_finished_req`` / ``cache_unfinished_req``):
the key is ``origin_input_ids + output_ids`` (generated tokens included), page-aligned (and
bigram with EAGLE); slots the request computed for tokens the tree already holds are
duplicates and are freed, the request's row is pointed at the tree's slots, the unaligned
tail is the request's until it finishes, and the request's lock moves to its new last node.

Unlike SGLang, which re-walks the whole key from the root (twice, in ``cache_unfinished_req``),
the lifecycle resumes at the request's locked ``last_node``: the tree under a locked node cannot
change except by splits, which keep the node object and its depth, so the path to it is still
the request's first ``cache_protected_len`` tokens. Caching a chunk costs O(chunk + new nodes),
flat in the request's length.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from kvjax.radix.chunk_cache import chunk_finished, chunk_unfinished, free_slots, request_row
from kvjax.radix.events import EventSink
from kvjax.radix.eviction import EvictionPolicy
from kvjax.radix.keys import INT32, as_slot_array, encode_tokens
from kvjax.radix.match import MatchResult
from kvjax.radix.node import TreeNode
from kvjax.radix.tree import RadixTree


class RadixCache(RadixTree):
    """Radix prefix cache over full-attention KV slots.

    Args:
        page_size: tokens per page; matches and cached edges are whole pages.
        eviction_policy: ``lru`` (default), ``lfu``, ``fifo``, ``mru``, ``filo``, ``priority``,
            ``slru``; an unknown name raises ``kvjax.ConfigError``.
        req_to_token_pool: request → token-slot table (``req_to_token`` int32 [rows, width]),
            needed by the lifecycle methods.
        token_to_kv_pool_allocator: allocator with ``free(np.ndarray)`` and ``size``; evicted
            and duplicate slots are freed into it. Without one the tree frees nothing.
        disable: radix cache off: behaves like ``ChunkCache`` (nothing cached or shared).
        is_eagle: bigram keys for EAGLE speculative decoding.
        enable_kv_cache_events / event_sink: KV events (see ``events.py``).
        enable_metrics: kept for interface parity; the O(1) counters in :attr:`stats` are
            always kept.
        hash_seed, eviction_policy_config: see :class:`RadixTree`.
    """

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str | EvictionPolicy = "lru",
        *,
        req_to_token_pool: Any | None = None,
        token_to_kv_pool_allocator: Any | None = None,
        disable: bool = False,
        is_eagle: bool = False,
        enable_kv_cache_events: bool = False,
        event_sink: EventSink | None = None,
        enable_metrics: bool = False,
        hash_seed: int | bytes | str = 0,
        eviction_policy_config: dict | None = None,
        components: tuple = (),
    ) -> None:
        super().__init__(
            page_size,
            eviction_policy,
            allocator=token_to_kv_pool_allocator,
            is_eagle=is_eagle,
            components=components,
            enable_kv_cache_events=enable_kv_cache_events,
            event_sink=event_sink,
            hash_seed=hash_seed,
            eviction_policy_config=eviction_policy_config,
        )
        self.disable = bool(disable)
        self.enable_metrics = bool(enable_metrics)
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        alloc = token_to_kv_pool_allocator
        # Slot ids live in [0, size + page_size): page 0 is the trash page.
        self._slot_limit = None if alloc is None else int(alloc.size) + int(getattr(alloc, "page_size", self.page_size))

    def is_chunk_cache(self) -> bool:
        """True when disabled (a disabled tree behaves like a chunk cache)."""
        return self.disable

    def is_tree_cache(self) -> bool:
        return not self.disable

    # ------------------------------------------------------------------ match / insert

    @staticmethod
    def _source(token_ids: Any, n_tokens: int) -> tuple[Any, bool]:
        """The walk form of a request: its list as is (never copied), or packed int32 bytes
        of the first ``n_tokens`` tokens of a numpy array."""
        if isinstance(token_ids, list):
            return token_ids, False
        if isinstance(token_ids, np.ndarray):
            return encode_tokens(token_ids, n_tokens), True
        return list(token_ids), False  # tuples and other sequences compare as lists

    def _key_len(self, n_tokens: int) -> int:
        """Key elements used for ``n_tokens`` tokens: bigram, then page-aligned."""
        n = n_tokens - self._ex
        if n <= 0:
            return 0
        return n - n % self.page_size

    def match_prefix(self, token_ids: Any, extra_key: Hashable = None) -> MatchResult:
        """The longest cached, page-aligned prefix of ``token_ids`` in namespace ``extra_key``.

        Splits the node where the match ends, so the returned node's boundary is exact, and
        refreshes access times along the path. ``token_ids`` shorter than a page (or than 2
        tokens with bigram keys) match nothing. With :attr:`force_miss` the walk still runs
        but nothing is reported as a hit.
        """
        if self.disable:
            return MatchResult(np.empty(0, dtype=INT32), self.root)
        # Inlined _source/_key_len: this is the hottest public call.
        if type(token_ids) is list:
            src, is_bytes, n = token_ids, False, len(token_ids) - self._ex
        elif isinstance(token_ids, np.ndarray):
            src, is_bytes, n = None, True, int(token_ids.shape[0]) - self._ex
        else:
            src, is_bytes = list(token_ids), False
            n = len(src) - self._ex
        ps = self.page_size
        if n < 0:
            n = 0
        elif ps > 1:
            n -= n % ps
        st = self.stats
        st.num_matches += 1
        st.query_tokens += n
        st.last_query_tokens = n
        if n == 0:
            st.last_hit_tokens = 0
            return MatchResult(np.empty(0, dtype=INT32), self.root)
        if is_bytes:
            src = encode_tokens(token_ids, n + self._ex)
        self._clock += 1
        node, matched, vals = self._match_walk(src, is_bytes, n, extra_key, self._clock)
        for c in self._extra:
            node, matched = c.limit_match(node, matched)
        if self._eager and node in self._leaves:
            self._defer_push(node)
        if self.force_miss or matched == 0:
            st.last_hit_tokens = 0
            return MatchResult(np.empty(0, dtype=INT32), self.root)
        st.hit_tokens += matched
        st.last_hit_tokens = matched
        return MatchResult.from_parts(vals, node, matched)

    def insert(
        self,
        token_ids: Any,
        indices: Any = None,
        extra_key: Hashable = None,
        priority: int = 0,
        *,
        chunked: bool = False,
    ) -> int:
        """Cache ``token_ids`` → ``indices`` (one KV slot per token); return the length that was
        already cached (key elements). The caller owns — and must free — its slots for that
        already-cached part when they differ from the tree's.

        Only the page-aligned part is cached (one element fewer with bigram keys). Priority is
        propagated as a max along the path. ``indices=None`` (standalone trees only) caches
        synthesized slot ids. ``chunked`` inserts do not count as hits (SGLang).

        Raises (tree unchanged): ValueError for indices of the wrong length, shape or dtype,
        or None with an allocator attached; ``kvjax.InvalidSlotError`` for negative slots or
        slots >= allocator size + page size.
        """
        if self.disable:
            return 0
        if type(token_ids) is not list and not isinstance(token_ids, np.ndarray):
            token_ids = list(token_ids)
        n_tok = len(token_ids) if type(token_ids) is list else int(token_ids.shape[0])
        if indices is None:
            if self._full.allocator is not None:
                raise ValueError(
                    "insert: indices=None only for standalone trees; pass the slot ids when an allocator is attached"
                )
            values = None
        else:
            values = as_slot_array(indices, n_tok, self._slot_limit)
        n = n_tok - self._ex
        if n > 0 and self.page_size > 1:
            n -= n % self.page_size
        self.stats.num_inserts += 1
        if n <= 0:
            return 0
        is_bytes = type(token_ids) is not list
        src = encode_tokens(token_ids, n + self._ex) if is_bytes else token_ids
        self._clock += 1
        _, matched, _ = self._insert_walk(
            self.root,
            src,
            is_bytes,
            n,
            values,
            extra_key,
            int(priority) if priority else 0,
            self._clock,
            not chunked,
            False,
        )
        return matched

    # ------------------------------------------------------------------ request lifecycle

    def _resume_point(self, req: Any) -> tuple[TreeNode, int]:
        """Where the request's key can be continued: its locked ``last_node`` at
        ``cache_protected_len`` when that is consistent, else the root at 0."""
        node = req.last_node
        cpl = req.cache_protected_len
        if (
            isinstance(node, TreeNode)
            and node is not self.root
            and node.owner is self._owner
            and node.value is not None
            and node.lock_ref > 0
            and node.depth == cpl
            and node.extra_key == req.extra_key
        ):
            return node, cpl
        return self.root, 0

    def _insert_req(
        self, req: Any, row: np.ndarray, n: int, tokens_fn: Any, count_hit: bool
    ) -> tuple[TreeNode, TreeNode, int]:
        """Insert the request's key elements ``[0, n)`` (resumed), free its duplicates and
        point its row at the tree's slots. Returns (resume node, last node, time)."""
        start, s = self._resume_point(req)
        t = self._tick()
        self.stats.num_inserts += 1
        if n <= s:
            return start, start, t
        src, is_bytes = self._source(tokens_fn(s, n + self._ex), n + self._ex - s)
        node, m_rel, vals = self._insert_walk(
            start, src, is_bytes, n - s, row[s:n], req.extra_key, req.priority, t, count_hit, True
        )
        matched = s + m_rel
        cpl = req.cache_protected_len
        if matched > cpl and m_rel:
            tree_slots = np.concatenate(vals)[cpl - s :] if cpl >= s else None
            if tree_slots is not None:
                dup = row[cpl:matched]
                differ = dup != tree_slots
                if differ.any():
                    # The request computed these tokens too: its slots are duplicates. Free
                    # them, then point the row at the tree's (a stale row would read freed KV).
                    free_slots(self._full.allocator, dup[differ])
                    self._write_row(req, cpl, tree_slots)
        return start, node, t

    def _write_row(self, req: Any, start: int, values: np.ndarray) -> None:
        pool = self.req_to_token_pool
        write = getattr(pool, "write", None)
        if write is not None:
            write(req.req_pool_idx, start, values)
        else:
            pool.req_to_token[req.req_pool_idx, start : start + len(values)] = values

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """Cache a finished request's KV and release it.

        Key: ``(origin_input_ids + output_ids)[:kv_len]`` (bigram with EAGLE), page-aligned.
        With ``is_insert``: insert it, free the request's duplicates of what the tree already
        held in ``[cache_protected_len, already cached)``; without: free
        ``[cache_protected_len, aligned length)``. Then free the unaligned tail
        ``[aligned length, kv_len)`` and release the request's lock. The request's row is not
        freed (the caller returns it to the request pool).
        """
        if self.disable:
            chunk_finished(self.req_to_token_pool, self._full.allocator, req)
            return
        row = request_row(self.req_to_token_pool, req, "cache_finished_req")
        kv_len = req.kv_len()
        n = self._key_len(kv_len)
        alloc = self._full.allocator
        if is_insert:
            start, _, t = self._insert_req(req, row, n, req.token_range, True)
            self._touch_path(start, t, req.priority, True)
        else:
            free_slots(alloc, row[req.cache_protected_len : n].copy())
        if kv_len > n:
            free_slots(alloc, row[n:kv_len].copy())
        self.dec_lock_ref(req.lock_receipt if req.lock_receipt is not None else req.last_node)
        req.lock_receipt = None
        req.last_node = None

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """Cache the KV a running request has so far (chunked prefill) and keep it locked.

        Key: ``fill_ids`` (bigram with EAGLE), page-aligned. Inserts it, frees the request's
        duplicates in ``[cache_protected_len, already cached)`` and points the row there at the
        tree's slots, sets ``cache_protected_len`` to the aligned length, moves the lock to the
        new last node, and sets ``prefix_indices`` to the row's first ``len(fill_ids)`` slots
        (a read-only view: the tree's slots, then the request's partial page / last token).

        ``chunked`` (a chunked-prefill step, as SGLang's scheduler passes it): the step does not
        count as a hit. The cost is O(chunk + new nodes) at any request length, plus O(depth)
        for a non-chunked call under a hit-counting policy (lfu, slru).
        """
        if self.disable:
            chunk_unfinished(self.req_to_token_pool, req)
            return
        row = request_row(self.req_to_token_pool, req, "cache_unfinished_req")
        fill_len = req.fill_len()
        n = self._key_len(fill_len)
        start, node, t = self._insert_req(req, row, n, req.fill_range, not chunked)
        if not chunked and self.policy.uses_hit_count:
            # SGLang's insert walks from the root and counts a hit on every node of the path.
            # Only hit-count policies can observe that: the path above the request's node is
            # locked by the request, so its access times and priorities cannot matter before
            # cache_finished_req refreshes them. Chunked steps never count (SGLang), so a
            # chunked-prefill step stays O(chunk + new nodes) at any length.
            self._touch_path(start, t, req.priority, True)
        old = req.lock_receipt if req.lock_receipt is not None else req.last_node
        req.lock_receipt = self._move_lock(old, node)
        req.last_node = node
        req.cache_protected_len = node.depth if node is not self.root else 0
        view = row[:fill_len]
        view.flags.writeable = False
        req.prefix_indices = view

    def match_and_lock(self, req: Any) -> MatchResult:
        """Match the request's tokens, lock the prefix and record it on the request
        (``prefix_indices``, ``last_node``, ``lock_receipt``, ``cache_protected_len``,
        ``cached_tokens``): the scheduler's usual first step.

        At most ``len(fill_ids) - 1`` tokens are matched: the forward needs at least one token
        to compute the next token's logits (a full hit would leave nothing to run).
        """
        n = req.fill_len() - 1
        m = self.match_prefix(req.fill_range(0, n) if n > 0 else [], req.extra_key)
        req.prefix_indices = m.indices
        req.last_node = m.last_node
        req.lock_receipt = self.inc_lock_ref(m.last_node)
        req.cache_protected_len = m.prefix_len
        req.cached_tokens = m.prefix_len
        return m
