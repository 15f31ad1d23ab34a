"""`RadixCache`: the full-KV prefix cache (SGLang's ``RadixCache`` contract) on the tree core.

Use it standalone for simulation (``RadixCache(page_size=16)``; ``insert(tokens)`` then
synthesizes slot ids) or with the request pool and allocator of a serving loop.

Request lifecycle (SGLang semantics, see ``cache_finished_req`` / ``cache_unfinished_req``):
the key is ``origin_input_ids + output_ids`` (generated tokens included), page-aligned (and
bigram with EAGLE); slots the request computed for tokens the tree already holds are
duplicates and are freed, the request's row is pointed at the tree's slots, the unaligned
tail is the request's until it finishes, and the request's lock moves to its new last node.

SGLang 0.5.23's rules, followed here (``docs/architecture.md``, "Request lifecycle"):

* prompt/output split: once a request's key reaches past its page-aligned prompt, the node
  holding the prompt boundary is split there and the prompt path gets priority ``+ 1`` (0.5.23
  re-inserts the prompt part with ``priority + 1``), so eviction can drop a request's output KV
  before its prompt;
* hits (``lfu``/``slru``): a request counts each node once — a node counts a hit when its end
  depth exceeds ``req.cache_inserted_len``, the longest key the request inserted so far —
  chunked steps included;
* frees: duplicates in row order, then the unaligned tail; a request released without insert
  (retraction) frees its own slots ``[cache_protected_len, kv_len)`` as one range; eviction
  frees node by node in eviction order;
* 0.5.23's names ``match_kv_cache``, ``checkpoint_kv_cache`` and
  ``release_kv_cache(checkpoint=...)`` sit beside ``match_and_lock``, ``cache_unfinished_req``
  and ``cache_finished_req``.

Unlike SGLang, which re-walks the whole key from the root (twice per checkpoint, plus the
prompt re-insert), the lifecycle resumes at the request's locked ``last_node``: the tree under a
locked node cannot change except by splits, which keep the node object and its depth, so the
path to it is still the request's first ``cache_protected_len`` tokens. Caching a chunk costs
O(chunk + new nodes), flat in the request's length; the path above the resume point is walked
only where 0.5.23's walk changes something observable: the first checkpoint after a match
(priority, hits), the first time the key passes the prompt (split, prompt priority + 1), the
finish, and a release without insert (the receipt replays the last checkpoint's access times).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvjax.errors import ConfigError
from kvjax.radix.chunk_cache import chunk_finished, chunk_unfinished, free_row_segment, request_row
from kvjax.radix.component import TreeComponent
from kvjax.radix.events import EventSink
from kvjax.radix.eviction import EvictionPolicy
from kvjax.radix.insert_result import InsertResult
from kvjax.radix.keys import INT32, as_slot_array, encode_tokens
from kvjax.radix.lock import LockReceipt
from kvjax.radix.match import ComponentMatchResult, MatchResult
from kvjax.radix.node import TreeNode
from kvjax.radix.retention import check_retention_seconds
from kvjax.radix.tiered_tree import TieredTree

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol
    from kvjax.radix.host_component import HostTierComponent
    from kvjax.radix.storage_link import StorageOptions
    from kvjax.request import Req

_NO_HITS = sys.maxsize  # ``hit_from`` that counts no hit

_Alloc = TypeVar("_Alloc")


def one_token_allocator(allocator: _Alloc | None, token_to_kv_pool_allocator: _Alloc | None) -> _Alloc | None:
    """The token allocator of a tree that takes it as ``allocator`` or under SGLang's name
    ``token_to_kv_pool_allocator``: whichever is given (None: neither, a standalone tree).

    Raises ConfigError when both are given and are different objects.
    """
    if allocator is None:
        return token_to_kv_pool_allocator
    if token_to_kv_pool_allocator is not None and token_to_kv_pool_allocator is not allocator:
        raise ConfigError(
            "allocator", allocator, "pass the token allocator once (allocator or token_to_kv_pool_allocator)"
        )
    return allocator


class RadixCache(TieredTree):
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
        components: further components beside FULL (SWA, Mamba; the presets pass them).
        host, storage: the host tier component and the storage tier behind it (see
            :class:`~kvjax.radix.tiered_tree.TieredTree`; ``HiRadixCache`` builds them).
    """

    # A tree whose components free slots while an insert walks (SWA revivals) frees the caller's
    # duplicates in the walk too, node by node, so that frees run in SGLang's walk order:
    # ``_walk_dups`` is (first position whose incoming slots are the caller's, SWA-evicted
    # positions) while such a walk runs.
    _dups_in_walk = False

    __slots__ = (
        "disable",
        "last_insert_node",
        "_last_insert_results",
        "enable_metrics",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
        "_slot_limit",
        "_walk_dups",
    )

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str | EvictionPolicy = "lru",
        *,
        req_to_token_pool: ReqToTokenPoolProtocol | None = None,
        token_to_kv_pool_allocator: AllocatorProtocol | None = None,
        disable: bool = False,
        is_eagle: bool = False,
        enable_kv_cache_events: bool = False,
        event_sink: EventSink | None = None,
        enable_metrics: bool = False,
        hash_seed: int | bytes | str = 0,
        eviction_policy_config: dict | None = None,
        components: Sequence[TreeComponent] = (),
        host: HostTierComponent | None = None,
        storage: StorageOptions | None = None,
    ) -> None:
        super().__init__(
            page_size,
            eviction_policy,
            allocator=token_to_kv_pool_allocator,
            is_eagle=is_eagle,
            components=components,
            host=host,
            storage=storage,
            enable_kv_cache_events=enable_kv_cache_events,
            event_sink=event_sink,
            hash_seed=hash_seed,
            eviction_policy_config=eviction_policy_config,
        )
        self.disable = bool(disable)
        # The node the latest ``insert`` ended at, and the components' results of that insert
        # (what ``insert_with`` returns); kept on the tree so ``insert`` builds no result object.
        self.last_insert_node: TreeNode = self.root
        self._last_insert_results: dict[str, Any] = {}
        self.enable_metrics = bool(enable_metrics)
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        alloc = token_to_kv_pool_allocator
        # Slot ids live in [0, size + page_size): page 0 is the trash page.
        self._slot_limit = None if alloc is None else int(alloc.size) + int(alloc.page_size)
        self._walk_dups: tuple[int, int] | None = None

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
        tokens with bigram keys) match nothing. The device match stops above host-only nodes;
        components then finalise it (``MatchResult.extras``, ``full_kv_hit_length``). With
        :attr:`force_miss` the walk still runs but nothing is reported as a hit.
        """
        if self.disable:
            return MatchResult(np.empty(0, dtype=INT32), self.root)
        # Inlined _source/_key_len: this is the hottest public call.
        src: Any
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
            if self._extra:
                return self._finalize_match(self.root, 0, [])
            return MatchResult(np.empty(0, dtype=INT32), self.root)
        if is_bytes:
            src = encode_tokens(token_ids, n + self._ex)
        self._clock += 1
        node, matched, vals = self._walk(self.root, src, is_bytes, n, extra_key, self._clock, False)
        if self._extra:
            return self._finalize_match(node, matched, vals)
        if self._eager and node in self._leaves:
            self._evq.defer_push(node)
        if self.force_miss or matched == 0:
            st.last_hit_tokens = 0
            return MatchResult.from_parts((), self.root, 0)  # indices: a fresh empty array on access
        st.hit_tokens += matched
        st.last_hit_tokens = matched
        return MatchResult.from_parts(vals, node, matched)

    def _finalize_match(self, node: TreeNode, matched: int, vals: list) -> MatchResult:
        """The match with components: cut the device part above host-only nodes, then let each
        component shorten it and add its results."""
        root = self.root
        walk = None
        if self._host_only and vals and vals[-1] is None:
            walk = node
            while node is not root and node.value is None:
                node = node.parent
            matched = 0 if node is root else node.depth
            vals = [v for v in vals if v is not None]
        result = ComponentMatchResult.from_walk(vals, node, matched, walk)
        for c in self._extra:
            c.finalize_match(result)
        # Recency from where the components let the match end (a host tier's deepest loadable
        # node), up to the root: the deeper nodes the walk passed keep their times.
        self.touch_to_root(result.last_host_node, self._clock)
        node = result.last_node
        if self._eager and node in self._leaves:
            self._evq.defer_push(node)
        st = self.stats
        if self.force_miss:
            st.last_hit_tokens = 0
            return MatchResult(np.empty(0, dtype=INT32), root)
        st.hit_tokens += result.prefix_len
        st.last_hit_tokens = result.prefix_len
        return result

    def insert(
        self,
        token_ids: Any,
        indices: Any = None,
        extra_key: Hashable = None,
        priority: int = 0,
        *,
        chunked: bool = False,
        inserted_len: int = 0,
        payloads: Mapping[str, Any] | None = None,
        donate_key: bool = False,
        retention_seconds: float | None = None,
    ) -> int:
        """Cache ``token_ids`` → ``indices`` (one KV slot per token); return the length that was
        already cached (key elements). The caller owns — and must free — its slots for that
        already-cached part when they differ from the tree's.

        ``retention_seconds``: retain every node of the inserted path for that long from the
        retention clock's reading, at ``priority`` (``retention.py``; None or 0: no retention).

        ``donate_key=True`` hands a ``list`` key over to the tree, as a donated buffer is handed
        to a jitted call: the new node keeps the list itself instead of a copy (cutting off a
        partial page in place): as its edge when none of it was cached (a later split cuts it in
        place), else while the cached head is at most ``walk.SHARE_MAX_HEAD`` times the new
        edge, as the list its edge is the tail of (``TreeNode.kshare``). The caller must not
        read or change the list afterwards. SGLang's and
        sglang-jax's trees always keep the caller's key object this way; kvjax copies unless
        asked, and its request lifecycle donates the keys it builds itself.

        Only the page-aligned part is cached (one element fewer with bigram keys). Priority is
        propagated as a max along the path. ``indices=None`` (standalone trees only) caches
        synthesized slot ids. Hits (``lfu``, ``slru``): every node ending past ``inserted_len``
        counts one (SGLang 0.5.23); ``chunked=True`` counts none (the older rule). ``payloads``
        are per-component insert payloads by name; use :meth:`insert_with` to receive the
        components' results (e.g. a donated slot handed back, which the caller must free).
        :attr:`last_insert_node` is the node the insert ended at.

        Raises (tree unchanged): ValueError for indices of the wrong length, shape or dtype,
        or None with an allocator attached, a payload for an unknown component, or a
        ``retention_seconds`` that is not a finite number >= 0;
        ``kvjax.InvalidSlotError`` for negative slots or slots >= allocator size + page size.
        """
        if retention_seconds is not None:
            retention_seconds = check_retention_seconds(retention_seconds)
        if self.disable:
            return 0
        if payloads:
            for name in payloads:
                if name not in self._by_name or name == self._full.name:
                    raise ValueError(
                        f"insert: payload for {name!r}, which is not a component of this tree "
                        f"(components with payloads: {', '.join(c.name for c in self._extra) or 'none'})"
                    )
        if type(token_ids) is list:
            n_tok = len(token_ids)
            is_bytes = False
        elif isinstance(token_ids, np.ndarray):
            n_tok = int(token_ids.shape[0])
            is_bytes = True
        else:
            token_ids = list(token_ids)
            n_tok = len(token_ids)
            is_bytes = False
            donate_key = True  # the list was built here
        if indices is None:
            if self._full.allocator is not None:
                raise ValueError(
                    "insert: indices=None only for standalone trees; pass the slot ids when an allocator is attached"
                )
            values = None
        elif (
            type(indices) is np.ndarray
            and indices.dtype is INT32
            and self._slot_limit is None
            and indices.ndim == 1
            and indices.shape[0] == n_tok
            and n_tok
            and indices.item(indices.argmin()) >= 0
        ):
            values = indices  # ``as_slot_array``'s fast path without an allocator, inlined
        else:
            values = as_slot_array(indices, n_tok, self._slot_limit)
        n = n_tok - self._ex
        if n > 0 and self.page_size > 1:
            n -= n % self.page_size
        self.stats.num_inserts += 1
        if n <= 0:
            node, matched = self.root, 0
        else:
            src = encode_tokens(token_ids, n + self._ex) if is_bytes else token_ids
            self._clock += 1
            node, matched, _ = self._walk(
                self.root,
                src,
                is_bytes,
                n,
                extra_key,
                self._clock,
                True,
                values,
                int(priority) if priority else 0,
                _NO_HITS if chunked else inserted_len,
                False,
                payloads,
                donate_key,
            )
        self.last_insert_node = node
        if retention_seconds:
            self.retain_path(node, int(priority) if priority else 0, retention_seconds)
        if self._extra:
            self._last_insert_results = self._commit(node, payloads)
        return matched

    def insert_with(self, *args: Any, **kwargs: Any) -> InsertResult:
        """:meth:`insert`, returning the whole :class:`InsertResult` (prefix length, last node,
        per-component results). Same arguments and errors, the preset's own keywords included
        (``swa_evicted_seqlen`` on the sliding-window trees)."""
        matched = self.insert(*args, **kwargs)
        if self.disable:
            return InsertResult(0, self.root)
        return InsertResult(matched, self.last_insert_node, self._last_insert_results if self._extra else {})

    def _commit(self, node: TreeNode, payloads: Mapping[str, Any] | None) -> dict[str, Any]:
        """Each component's ``commit_insert`` on the insert's end node, by name."""
        return {c.name: c.commit_insert(node, payloads.get(c.name) if payloads else None) for c in self._extra}

    # ------------------------------------------------------------------ request lifecycle

    def _resume_point(self, req: Req) -> tuple[TreeNode, int]:
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
        self, req: Req, row: np.ndarray, n: int, tokens_fn: Any, payloads: Mapping[str, Any] | None = None
    ) -> tuple[TreeNode, TreeNode, int]:
        """Insert the request's key elements ``[0, n)`` (resumed), free its duplicates (node by
        node, each a row segment) and point its row at the tree's slots. A node ending past
        ``req.cache_inserted_len`` counts one hit. ``payloads``: the components' insert payloads
        (from :meth:`prepare_for_caching_req`); their results go to ``_last_insert_results``
        (empty when nothing was committed). Returns (resume node, last node, time)."""
        start, s = self._resume_point(req)
        t = self._tick()
        self.stats.num_inserts += 1
        self._last_insert_results = {}
        if n <= s:
            if self._extra and payloads and n == s:
                self._last_insert_results = self._commit(start, payloads)
            return start, start, t
        src, is_bytes = self._source(tokens_fn(s, n + self._ex), n + self._ex - s)
        if self._dups_in_walk:
            self._walk_dups = (req.cache_protected_len, self._row_evicted(req))
        try:
            node, m_rel, vals = self._walk(
                start,
                src,
                is_bytes,
                n - s,
                req.extra_key,
                t,
                True,
                row[s:n],
                req.priority,
                req.cache_inserted_len,
                True,
                payloads,
                True,  # ``tokens_fn`` built the list for this call: the tree may keep it
            )
        finally:
            self._walk_dups = None
        if self._extra:
            self._last_insert_results = self._commit(node, payloads)
        matched = s + m_rel
        cpl = req.cache_protected_len
        if matched > cpl and m_rel and vals is not None and cpl >= s:
            tree_slots = np.concatenate(vals)[cpl - s :]
            dup = row[cpl:matched]
            if (dup != tree_slots).any():
                # The request computed these tokens too: its slots are duplicates. Free
                # them, then point the row at the tree's (a stale row would read freed KV).
                if not self._dups_in_walk:
                    self._free_duplicates(node, dup, cpl, matched, self._row_evicted(req))
                self._write_row(req, cpl, tree_slots)
        return start, node, t

    def _free_duplicates(self, node: TreeNode, incoming: np.ndarray, lo: int, hi: int, evicted: int) -> None:
        """Free the caller's ``incoming`` slots of key positions ``[lo, hi)`` (``incoming[0]`` is
        position ``lo``) where they differ from the tree's, on the path ending at ``node``: node by
        node from the top, each node's part one row segment (SGLang 0.5.23's ``FreeDeviceKV`` per
        overlapped node). ``evicted``: the caller's positions before it hold no SWA slots."""
        alloc = self._full.allocator
        if alloc is None or hi <= lo:
            return
        parts = []
        root = self.root
        while node is not root and node.depth > lo:
            a = max(node.depth - node.klen, lo)
            b = min(node.depth, hi)
            if b > a:
                parts.append((node, a, b))
            node = node.parent
        for node, a, b in reversed(parts):
            first = node.depth - node.klen
            value = node.value
            assert value is not None, "an insert makes every node on its path device-resident"
            mine = incoming[a - lo : b - lo]
            differ = mine != value[a - first : b - first]
            if differ.any():
                self._free_row_segment(mine if differ.all() else mine[differ], a, evicted)

    def _row_evicted(self, req: Req) -> int:
        """Positions ``[0, e)`` of the request's row whose SWA slots its decode already freed
        (0: a tree without an SWA pool)."""
        return 0

    def _free_row_segment(self, slots: np.ndarray, start: int, evicted: int) -> None:
        """Free ``slots``, row positions ``[start, start + len(slots))``, as one row segment
        (``evicted``: see :meth:`_row_evicted`; used by trees with an SWA pool)."""
        free_row_segment(self._full.allocator, slots, start)

    def _prompt_len(self, req: Req) -> int:
        """Key elements of the request's page-aligned prompt."""
        inp = req.origin_input_ids
        return self._key_len(int(inp.shape[0]) if isinstance(inp, np.ndarray) else len(inp))

    def _split_prompt(self, req: Req, last: TreeNode, n: int, prompt_len: int, t_prompt: int) -> None:
        """SGLang 0.5.23's prompt re-insert (``_insert_cache(split_prompt=True)``) for a key of
        ``n`` elements whose page-aligned prompt is ``prompt_len`` (``0 < prompt_len < n``):
        split the node holding the prompt boundary there and give the prompt path time
        ``t_prompt`` and priority ``+ 1``. While the request runs this is done once (once the
        boundary exists, 0.5.23's repeated re-inserts only refresh a path the request keeps
        locked); at its finish once more."""
        node = last
        root = self.root
        while node is not root and node.depth - node.klen >= prompt_len:
            node = node.parent
        if node is root:
            return
        if node.depth > prompt_len:
            node = self._split(node, prompt_len - (node.depth - node.klen))
        self._touch_path(node, t_prompt, req.priority, _NO_HITS, prompt_len, t_prompt)

    def _replay_touch(self, lock: LockReceipt) -> None:
        """A request released without an insert (retraction): give its locked path the access
        times 0.5.23's walks from the root gave it at its last checkpoint (the path, then the
        prompt part later), which the resumed lifecycle skipped. O(depth), once per release."""
        assert lock.touch is not None
        t, t_prompt, prompt_len = lock.touch
        node = lock.node
        root = self.root
        while isinstance(node, TreeNode) and node is not root:
            stamp = t_prompt if t_prompt >= 0 and node.depth <= prompt_len else t
            if node.last_access < stamp:
                node.last_access = stamp
            node = node.parent

    def _retain_req(self, req: Req, node: TreeNode) -> None:
        """A request with ``retention_seconds`` retains the path it inserted through, ending at
        ``node`` (``retention.py``). Requests without one (or another record type without the
        field) change nothing."""
        seconds = getattr(req, "retention_seconds", None)
        if seconds:
            self.retain_path(node, req.priority, seconds)

    def _write_row(self, req: Req, start: int, values: np.ndarray) -> None:
        pool = self.req_to_token_pool
        if pool is None:
            raise ValueError("this cache has no req_to_token_pool; pass one to use the request lifecycle")
        if req.req_pool_idx is None:
            raise ValueError(f"request {req.rid!r} has no req_pool_idx")
        pool.write(req.req_pool_idx, start, values)

    def _lock_of(self, req: Req) -> Any:
        return req.lock_receipt if req.lock_receipt is not None else req.last_node

    # -- component hooks around the lifecycle insert (SGLang 0.5.23's names) ----------------------

    def prepare_for_caching_req(self, req: Req, key_len: int, is_finished: bool) -> tuple[int, dict[str, Any] | None]:
        """Before the lifecycle inserts ``key_len`` key elements of ``req``: a tree with
        components may lower the cacheable length (never below ``req.cache_protected_len``) and
        give per-component insert payloads. The plain tree keeps both as they are."""
        return key_len, None

    def cleanup_after_caching_req(
        self, req: Req, is_finished: bool, payloads: dict[str, Any] | None, results: dict[str, Any] | None
    ) -> None:
        """After the lifecycle insert (``results``: the components' insert results; None when the
        request was released without an insert): free what the tree did not take."""

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Cache a finished request's KV and release it (0.5.23: ``release_kv_cache``).

        Key: ``(origin_input_ids + output_ids)[:kv_len]`` (bigram with EAGLE), page-aligned.
        With ``is_insert``: insert it, free the request's duplicates of what the tree already
        held in ``[cache_protected_len, already cached)`` (node by node), split at the prompt
        boundary (prompt priority + 1), then free the unaligned tail ``[aligned length, kv_len)``.
        Without (a retracted or aborted request): free ``[cache_protected_len, kv_len)`` as one
        range. Every free is a row segment (``free_segment``: pages in row order, 0.5.23). Then
        release the request's lock and reset ``cache_inserted_len`` to 0. The request's row is
        not freed (the caller returns it to the request pool).
        """
        if self.disable:
            chunk_finished(self.req_to_token_pool, self._full.allocator, req)
            return
        row = request_row(self.req_to_token_pool, req, "cache_finished_req")
        kv_len = req.kv_len()
        if is_insert:
            n, payloads = self.prepare_for_caching_req(req, self._key_len(kv_len), True)
            inserted_before = req.cache_inserted_len
            start, last, t = self._insert_req(req, row, n, req.token_range, payloads)
            prompt_len = self._prompt_len(req)
            t_prompt = self._tick()
            if not 0 < prompt_len < n:
                prompt_len = -1
            else:
                self._split_prompt(req, last, n, prompt_len, t_prompt)
            self._touch_path(start, t, req.priority, inserted_before, prompt_len, t_prompt)
            self._retain_req(req, last)
            if kv_len > n:
                self._free_row_segment(row[n:kv_len].copy(), n, self._row_evicted(req))
            if self._extra:
                self.cleanup_after_caching_req(req, True, payloads, self._last_insert_results)
        else:
            cpl = req.cache_protected_len
            self._free_row_segment(row[cpl:kv_len].copy(), cpl, self._row_evicted(req))
            lock = self._lock_of(req)
            if isinstance(lock, LockReceipt) and lock.touch is not None and not lock.released:
                self._replay_touch(lock)
            if self._extra:
                self.cleanup_after_caching_req(req, True, None, None)
        self.dec_lock_ref(self._lock_of(req))
        req.lock_receipt = None
        req.last_node = None
        req.cache_inserted_len = 0

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Cache the KV a running request has so far and keep it locked (0.5.23:
        ``checkpoint_kv_cache``).

        Key: ``fill_ids`` (bigram with EAGLE), page-aligned. Inserts it, frees the request's
        duplicates in ``[cache_protected_len, already cached)`` and points the row there at the
        tree's slots, splits at the prompt boundary once the key passes it, sets
        ``cache_protected_len`` (and ``cache_inserted_len``) to the aligned length, moves the
        lock to the new last node, and sets ``prefix_indices`` to the row's first
        ``len(fill_ids)`` slots (a read-only view: the tree's slots, then the request's partial
        page / last token).

        Hits: each node once per request, chunked steps included (0.5.23); ``chunked`` is kept
        for callers and changes nothing. The cost is O(chunk + new nodes) at any request
        length, plus O(depth) once per request (first hits, the prompt split).
        """
        if self.disable:
            chunk_unfinished(self.req_to_token_pool, req)
            return
        row = request_row(self.req_to_token_pool, req, "cache_unfinished_req")
        fill_len = req.fill_len()
        n, payloads = self.prepare_for_caching_req(req, self._key_len(fill_len), False)
        inserted_before = req.cache_inserted_len
        start, node, t = self._insert_req(req, row, n, req.fill_range, payloads)
        if self._extra:
            self.cleanup_after_caching_req(req, False, payloads, self._last_insert_results)
        if start is not self.root and start.depth > inserted_before:
            # The request's first insert after a match: 0.5.23's walk from the root gives the
            # matched path its priority (a max) and one hit per node now. Afterwards that path is
            # the request's own locked path and already has both.
            self._touch_path(start, t, req.priority, inserted_before)
        prompt_len = self._prompt_len(req)
        t_prompt = -1
        if 0 < prompt_len < n:
            t_prompt = self._tick()  # 0.5.23 re-inserts the prompt part after the key
            if inserted_before <= prompt_len:
                # The key passes the prompt for the first time (before, it ended at or above it).
                self._split_prompt(req, node, n, prompt_len, t_prompt)
        self._retain_req(req, node)
        req.lock_receipt = receipt = self._move_lock(self._lock_of(req), node)
        receipt.touch = (t, t_prompt, prompt_len)
        req.last_node = node
        req.cache_protected_len = node.depth if node is not self.root else 0
        if n > req.cache_inserted_len:
            req.cache_inserted_len = n
        view = row[:fill_len]
        view.flags.writeable = False
        req.prefix_indices = view

    def match_and_lock(self, req: Req) -> MatchResult:
        """Match the request's tokens, lock the prefix and record it on the request
        (``prefix_indices``, ``last_node``, ``lock_receipt``, ``cache_protected_len``,
        ``cached_tokens``): the scheduler's usual first step.

        At most ``len(fill_ids) - 1`` tokens are matched: the forward needs at least one token
        to compute the next token's logits (a full hit would leave nothing to run).
        """
        n = req.fill_len() - 1
        return self._adopt(req, self.match_prefix(req.fill_range(0, n) if n > 0 else [], req.extra_key))

    def _adopt(self, req: Req, m: MatchResult) -> MatchResult:
        req.prefix_indices = m.indices
        req.last_node = m.last_node
        req.lock_receipt = self.inc_lock_ref(m.last_node)
        req.cache_protected_len = m.prefix_len
        req.cached_tokens = m.prefix_len
        return m

    # ------------------------------------------------------------------ SGLang 0.5.23 names

    def match_kv_cache(self, req: Req, token_ids: Any = None, *, max_prefix_len: int | None = None) -> MatchResult:
        """0.5.23's ``match_kv_cache``: match ``token_ids`` (default: the request's
        ``origin_input_ids + output_ids``, at most all but the last token) and adopt the hit as
        the request's prefix. Unlike 0.5.23, which locks in the scheduling policy afterwards,
        the lock is taken here (kvjax's lifecycle needs it from adoption on), as
        :meth:`match_and_lock` does."""
        if token_ids is None:
            total = req.seqlen()
            limit = total - 1 if max_prefix_len is None else min(total - 1, int(max_prefix_len))
            tokens = req.token_range(0, limit) if limit > 0 else []
        else:
            n_tok = int(token_ids.shape[0]) if isinstance(token_ids, np.ndarray) else len(token_ids)
            limit = n_tok if max_prefix_len is None else min(n_tok, int(max_prefix_len))
            tokens = token_ids[:limit] if limit > 0 else []
        return self._adopt(req, self.match_prefix(tokens, req.extra_key))

    def checkpoint_kv_cache(self, req: Req) -> None:
        """0.5.23's ``checkpoint_kv_cache``: publish what the running request has computed so
        far (:meth:`cache_unfinished_req`)."""
        self.cache_unfinished_req(req)

    def release_kv_cache(self, req: Req, *, checkpoint: bool) -> None:
        """0.5.23's ``release_kv_cache``: give the request's KV back; with ``checkpoint`` the
        tree first keeps what it can key (:meth:`cache_finished_req` with ``is_insert``)."""
        self.cache_finished_req(req, is_insert=checkpoint)
