"""`StorageLink`: the storage tier (SGLang's HiCache L3) behind a :class:`HiRadixCache`'s host tier.

Rules (``sglang-semantics.md`` §1.14, ``sglang-0.5.23-hybrid-trees.md``, host tier):

* **backup after host backup.** When a node's host copy lands (the host tier's
  ``writing_check``, or a write-back's synchronous copy), its pages are read from the host pool
  (``page_first`` order: one page of every layer) and written to the storage tier under their
  chained page hashes (pages the store holds already are skipped). The hashes are those of the
  node's path from the root in its namespace (``extra_key``) with the tree's ``hash_seed``: the
  hashes the tree's KV events carry for the same pages with the default hash. With KV events on,
  a write whose every page landed is reported at the polling step that sees it finish
  (``BlockStored`` in medium "storage", with the tree's event hashes; ``reported_pages``); the
  store removes nothing, and a reset forgets what was reported (its ``AllBlocksCleared``).
* **prefetch on a match miss.** :meth:`start_prefetch` hashes the key beyond the device + host
  match page by page and asks the store how many of them it holds, from the first. A leading run
  of at least ``prefetch_threshold`` tokens is prefetched: host slots are taken for it (evicting
  host-only leaves other than the matched chain if short; held outside the tree meanwhile), and
  the reads are started.
* **admission.** :meth:`check_prefetch_progress` says whether the request may be admitted, per
  the policy (``best_effort``: now; ``wait_complete``: once every read finished; ``timeout``: once
  every read finished or ``prefetch_timeout_s`` passed since the start: SGLang's 1 s + 0.25 s per
  1024 tokens by default), and then takes the
  leading run of pages that arrived: they are written into the first host slots and become one
  host-only node below the matched node (``tree.add_host_only_leaf``), which the host tier's
  load-back then brings to the device. Host slots of pages not taken are freed.

Several processes (``agreement`` not local; the host tier's serving extension sets the
scheduler's): every number a process reads from its own store is agreed (MIN over processes, as
SGLang all-reduces the storage hit count and a prefetch's ``completed_tokens``) before it
changes the tree or the host allocator: the stored run's pages at the start (so every process
takes the same host slots), whether a prefetch may be admitted (ready only once ready
everywhere), and the pages taken (every process inserts the shortest run any process received).
The calls come in the same order on every process, because their trees and their prefetches are
the same.

Faults lose nothing: a failed, missing or late read, and an entry the store refuses (torn or
corrupt; pages of another ``StorageKey``, i.e. another model, dtype, layout, page size or
namespace, are never even looked at), just give fewer pages (the request recomputes the rest); a
failed storage write leaves the page absent (later prefetches stop before it); when the tokens
got into the tree meanwhile (another request inserted them) or the node they hang from left it
(evicted), the prefetched pages are dropped. Nothing is locked while the reads are in flight.

Where kvjax differs: the storage reads are asynchronous (tensorstore futures) but the store is
asked synchronously how many pages it holds (SGLang asks in its prefetch thread); prefetched
pages become one host-only node (SGLang inserts them through its host insert path, with the same
result).

Bigram (EAGLE) keys: key element ``i`` is the token pair ``(i, i + 1)``, so a page of
``page_size`` elements covers ``page_size + 1`` tokens and is hashed over them (``page_hashes(...,
bigram=True)``, SGLang's bigram page hash), and a prefetched node's edge starts at its anchor's
last token (the tree's bigram edges overlap by one token). With a second store beside the pages
(below) bigram keys are refused (ValueError): no tree with one takes them.

A tree whose prefixes need more than the KV pages is given a second store beside the pages (SGLang's
``TRAILING_PAGES`` pools): the hybrid sliding-window tree its sliding layers' pages, valid for the
last window only (``StorageOptions.window``; ``kvjax.radix.storage_window``), the recurrent-state
tree its checkpoints, one state after a node's last page (``StorageOptions.checkpoints``;
``kvjax.radix.storage_checkpoint``). Their entries are stored beside the KV pages, and a
prefetch's hit and node follow them: the hit ends where the second store makes the prefix
servable, and its node carries what arrived of it. Such a tree (``storage_window_required`` /
``storage_checkpoints_required``) refuses a storage tier without it (NotImplementedError naming
the tree). For them a prefetch starts below the deepest node the match walked (the tree holds
every page above it, and a node there may lack only what the second store brings).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.multihost.agreement import Agreement, LocalAgreement
from kvjax.radix.events import BlockStored
from kvjax.radix.host_pages import HostPages
from kvjax.radix.node import DELETED, HOST_ONLY, TreeNode
from kvjax.radix.storage_checkpoint import CheckpointRead, CheckpointStore, StorageCheckpoints
from kvjax.radix.storage_window import StorageWindow, WindowRead, WindowStore
from kvjax.tiers.storage import PREFETCH_POLICIES, Prefetch, StorageTier, StorageWrite, page_hashes

if TYPE_CHECKING:
    from kvjax.radix.host_component import HostData, HostTierComponent
    from kvjax.radix.match import MatchResult

PREFETCH_THRESHOLD = 256  # SGLang's default, tokens


#: The medium of the storage tier's KV events (``kvjax.radix.events``).
STORAGE_MEDIUM = "storage"


@dataclass
class PrefetchOp:
    """One request's prefetch in flight: where its node will hang, its tokens (the new edge's: one more
    than its key elements with bigram keys), host slots and reads."""

    anchor: TreeNode
    tokens: list[int]
    extra_key: Any
    slots: np.ndarray
    prefetch: Prefetch
    started: float
    trailing: WindowRead | CheckpointRead | None = None  # the second store's reads


class StorageLink:
    """See the module docstring.

    Args:
        host: the tree's host tier component (attached).
        storage: the storage tier; its page shape must be one page of every layer of ``pages``.
        pages: the host pool's page data.
        prefetch_policy: ``best_effort`` (default), ``wait_complete`` or ``timeout``.
        prefetch_timeout_s: the ``timeout`` policy's wait, seconds (None: SGLang's 1 s + 0.25 s
            per 1024 prefetched tokens).
        prefetch_threshold: runs of fewer stored tokens are not prefetched (SGLang: 256).
        window: the windowed pool's store and host pool (module docstring); None: the tree
            needs none (NotImplementedError for a tree with ``storage_window_required``).
        checkpoints: the checkpoints' store and host state pool (module docstring); None: the
            tree needs none (NotImplementedError for a tree with ``storage_checkpoints_required``).

    Counters: ``pages_backed_up`` (pages handed to the store, skipped ones excluded),
    ``prefetched_tokens`` (tokens inserted from storage), ``prefetches`` (prefetches started),
    ``pages_held_back`` (pages this process had that the agreement took fewer of: another process
    had fewer stored or received).

    ``agreement``: how the store's answers are agreed with other processes (module docstring);
    ``LocalAgreement`` (one process) by default.
    """

    def __init__(
        self,
        host: HostTierComponent,
        storage: StorageTier,
        pages: HostPages,
        *,
        prefetch_policy: str = "best_effort",
        prefetch_timeout_s: float | None = None,
        prefetch_threshold: int = PREFETCH_THRESHOLD,
        window: WindowStore | None = None,
        checkpoints: CheckpointStore | None = None,
    ) -> None:
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ConfigError("prefetch_policy", prefetch_policy, f"use one of {list(PREFETCH_POLICIES)}")
        if prefetch_timeout_s is not None and not prefetch_timeout_s >= 0:
            raise ConfigError("prefetch_timeout_s", prefetch_timeout_s, "use a timeout >= 0 seconds")
        if prefetch_threshold < 0:
            raise ConfigError("prefetch_threshold", prefetch_threshold, "use a token count >= 0")
        tree = host.tree
        if tree.is_eagle and (window is not None or checkpoints is not None):
            raise ValueError("a storage tier with a second store beside the pages takes no bigram (EAGLE) keys")
        if storage.storage_key.page_size != tree.page_size:
            raise ConfigError(
                "storage page size",
                storage.storage_key.page_size,
                f"the store's key must have the tree's page size ({tree.page_size})",
            )
        if window is None and getattr(tree, "storage_window_required", False):
            raise NotImplementedError(
                f"the storage tier under {type(tree).__name__} needs its sliding-window pages stored beside the full "
                "layers' (StorageOptions.window), which kvjax builds through build_kv_cache on one device or a TP "
                "mesh only; drop hicache_storage_backend for this layout"
            )
        if checkpoints is None and getattr(tree, "storage_checkpoints_required", False):
            raise NotImplementedError(
                f"the storage tier under {type(tree).__name__} needs its recurrent-state checkpoints stored beside the "
                "KV pages (StorageOptions.checkpoints), which kvjax builds through build_kv_cache in one process "
                "only; drop hicache_storage_backend for this layout"
            )
        if window is not None and checkpoints is not None:
            raise ValueError("a storage link takes a window store or a checkpoint store, not both")
        self.window = None if window is None else StorageWindow(tree, window)
        self.checkpoints = None if checkpoints is None else StorageCheckpoints(tree, checkpoints)
        self.trailing: StorageWindow | StorageCheckpoints | None = self.window or self.checkpoints
        self.host = host
        self.tree = tree
        self.storage = storage
        self.pages = pages
        self.policy = prefetch_policy
        self.timeout_s = None if prefetch_timeout_s is None else float(prefetch_timeout_s)
        self.threshold = int(prefetch_threshold)
        self.page_size = tree.page_size
        self._writes: list[StorageWrite] = []
        # KV events: writes whose landing is reported (medium "storage"), with their event; the
        # page hashes reported since the last reset (the store keeps pages; nothing removes them).
        self._reported: list[tuple[StorageWrite, BlockStored]] = []
        self.reported_pages: set[Any] = set()
        self._ops: dict[Any, PrefetchOp] = {}
        self.pages_backed_up = 0
        self.prefetched_tokens = 0
        self.prefetches = 0
        self.pages_held_back = 0
        self.agreement: Agreement = LocalAgreement()
        host.on_backup_landed = self.backup

    # -- hashes ---------------------------------------------------------------------------------

    def _path_tokens(self, node: TreeNode) -> list[int]:
        """The tokens from the root to ``node``'s end (with bigram keys each edge after the first
        starts at its parent's last token: that overlap is counted once)."""
        parts = []
        n = node
        while n is not self.tree.root:
            parts.append(n.token_ids())
            n = n.parent
        overlap = int(self.tree.is_eagle)
        ordered = list(reversed(parts))
        return [t for i, part in enumerate(ordered) for t in (part if i == 0 else part[overlap:])]

    def _hashes(self, tokens: Sequence[int], extra_key: Any) -> list[int]:
        return page_hashes(
            tokens, self.page_size, extra_key=extra_key, seed=self.tree.hash_seed, bigram=self.tree.is_eagle
        )

    def node_hashes(self, node: TreeNode) -> list[int]:
        """The chained hashes of ``node``'s own pages."""
        hashes = self._hashes(self._path_tokens(node), node.extra_key)
        return hashes[len(hashes) - node.klen // self.page_size :]

    # -- backup ---------------------------------------------------------------------------------

    def backup(self, node: TreeNode) -> None:
        """Write ``node``'s landed host copy to the store (the host tier calls this)."""
        data = self.host.data(node)
        if data is None or node.residency == DELETED:
            return
        buf = self.pages.read_pages(data.slots, self.storage.dtype)
        hashes = self.node_hashes(node)
        write = self.storage.backup(hashes, np.swapaxes(buf, 0, 1))
        self.pages_backed_up += len(write.futures)
        self._writes.append(write)
        if self.tree.enable_kv_cache_events:
            self._reported.append((write, self.tree.stored_event(node, STORAGE_MEDIUM)))
        if self.trailing is not None:
            trailing_write = self.trailing.backup(node, data.slots, hashes)
            if trailing_write is not None:
                self._writes.append(trailing_write)

    def backup_checkpoint(self, node: TreeNode) -> None:
        """Write ``node``'s landed checkpoint copy to the checkpoint store, under the hash of its
        last page (the recurrent-state tree calls this when the copy lands)."""
        if self.checkpoints is None or node.residency == DELETED or node.klen < self.page_size:
            return
        write = self.checkpoints.backup_state(node, self.node_hashes(node)[-1])
        if write is not None:
            self._writes.append(write)

    def check_writes(self, wait: bool = False) -> int:
        """Forget the storage writes that finished (all of them, waiting, with ``wait``);
        returns how many write batches finished."""
        if wait:
            for w in self._writes:
                w.wait()
        still = [w for w in self._writes if not w.done()]
        done = len(self._writes) - len(still)
        self._writes = still
        if self._reported:
            self._report_landed()
        return done

    def _report_landed(self) -> None:
        """KV events: a ``BlockStored`` in medium "storage" for each finished write whose every
        page landed (pages stored before count as landed; a write with a failed page reports
        nothing, so a router never counts a page the store lacks)."""
        pending = []
        for write, event in self._reported:
            if not write.done():
                pending.append((write, event))
            elif write.wait() == len(write.futures):  # done: no wait, failures counted out
                self.reported_pages.update(event.block_hashes)
                self.tree.emit_event(event)
        self._reported = pending

    def forget_reported(self) -> None:
        """The tree was reset (its ``AllBlocksCleared`` covers the storage medium): nothing is
        reported any more, though the store keeps its pages."""
        self._reported = []
        self.reported_pages.clear()

    @property
    def pending_writes(self) -> int:
        return len(self._writes)

    # -- prefetch -------------------------------------------------------------------------------

    def start_prefetch(self, rid: Any, match: MatchResult, key: Any, extra_key: Any = None) -> int:
        """After ``match_prefix(key, extra_key)`` gave ``match``: start prefetching the stored
        run beyond its device + host hit for request ``rid``; returns its tokens (0: none started:
        under the threshold, no host room, or a prefetch of ``rid`` already in flight)."""
        if rid in self._ops:
            return 0
        tokens = [int(t) for t in key]
        ex = int(self.tree.is_eagle)  # bigram keys: one token more than the key's elements
        ps = self.page_size
        hit = match.prefix_len + int(getattr(match, "host_hit_length", 0))
        anchor = getattr(match, "last_host_node", None) or match.last_node
        if self.trailing is not None and match.walk_node is not self.tree.root:
            # the tree holds every page above the deepest node walked (SWA tombstones included)
            walked = match.walk_node
            if int(walked.depth) > hit:
                hit, anchor = int(walked.depth), walked
        whole = max(0, len(tokens) - ex) // ps * ps
        if whole - hit < max(self.threshold, ps):
            return 0
        hashes = self._hashes(tokens[: whole + ex], extra_key)[hit // ps :]
        n = self._agreed_pages("storage hits", self.storage.leading_hits(hashes)) * ps
        if self.trailing is not None and n:
            n = self._agreed_pages("storage trailing hits", self.trailing.restorable(hashes[: n // ps])) * ps
        if n < max(self.threshold, ps):
            return 0
        slots = self._alloc_guarded(anchor, n)
        if slots is None:
            return 0
        prefetch = self.storage.prefetch(hashes[: n // ps])
        trailing = None if self.trailing is None else self.trailing.start(hashes[: n // ps])
        self._ops[rid] = PrefetchOp(
            anchor, tokens[hit : hit + n + ex], extra_key, slots, prefetch, time.monotonic(), trailing
        )
        self.prefetches += 1
        return n

    def check_prefetch_progress(self, rid: Any) -> bool:
        """Whether request ``rid`` may be admitted now (see the module docstring); when it may,
        the pages that arrived are inserted (as a host-only node) first. True without a prefetch."""
        op = self._ops.get(rid)
        if op is None:
            return True
        done = op.prefetch.done() and (op.trailing is None or op.trailing.prefetch.done())
        waiting = self.policy == "wait_complete" and not done
        if self.policy == "timeout" and not done and time.monotonic() - op.started < self._timeout(op):
            waiting = True
        if not self._agreed("prefetch ready", int(not waiting)):
            return False
        self._finish(rid, "best_effort")
        return True

    def finish_prefetch(self, rid: Any) -> int:
        """Take request ``rid``'s prefetch now, waiting as its policy says; returns the tokens
        inserted into the tree (0 without a prefetch)."""
        return self._finish(rid, self.policy) if rid in self._ops else 0

    def cancel_prefetch(self, rid: Any) -> None:
        """Drop request ``rid``'s prefetch (an aborted request): its host slots are freed."""
        op = self._ops.pop(rid, None)
        if op is None:
            return
        op.prefetch.take("best_effort")  # cancels the reads in flight
        if op.trailing is not None and self.trailing is not None:
            self.trailing.cancel(op.trailing)  # type: ignore[arg-type]
        self.host.free_held(op.slots)

    def cancel_all(self) -> None:
        for rid in list(self._ops):
            self.cancel_prefetch(rid)

    @property
    def pending_prefetches(self) -> int:
        """Prefetches started and not yet finished or cancelled."""
        return len(self._ops)

    def prefetch_for(self, rid: Any) -> Prefetch:
        """The storage reads in flight for request ``rid`` (``done()`` says whether all finished).
        Raises KeyError naming ``rid`` when it has no prefetch pending."""
        op = self._ops.get(rid)
        if op is None:
            raise KeyError(f"no prefetch pending for request {rid!r}")
        return op.prefetch

    def _finish(self, rid: Any, policy: str) -> int:
        op = self._ops.pop(rid)
        pages = op.prefetch.take(policy, max(0.0, op.started + self._timeout(op) - time.monotonic()))
        pages = pages[: self._agreed_pages("prefetch pages", pages.shape[0])]
        n = pages.shape[0] * self.page_size
        ex = int(self.tree.is_eagle)
        trailing = self._take_trailing(op, policy, n + ex == len(op.tokens))
        leaf = None
        if n and op.anchor.residency != DELETED:
            try:
                leaf = self.tree.add_host_only_leaf(op.anchor, op.tokens[: n + ex], op.extra_key)
            except ValueError:  # the tokens got into the tree meanwhile
                leaf = None
        if leaf is None:
            n = 0
        else:
            self.pages.write_pages(op.slots[:n], np.swapaxes(pages, 0, 1))
            self.host.adopt_held(leaf, op.slots[:n])
            if self.trailing is not None and op.trailing is not None:
                if trailing is None:
                    self.trailing.dropped()
                else:
                    self.trailing.adopt(leaf, op.slots, op.trailing, trailing)  # type: ignore[arg-type]
        if n < op.slots.size:
            self.host.free_held(op.slots[n:])
        self.prefetched_tokens += n
        return n

    def _take_trailing(self, op: PrefetchOp, policy: str, whole: bool) -> np.ndarray | None:
        """The second store's pages of ``op`` when every KV page of its run was taken (``whole``)
        and every one of them arrived (agreed over processes), else None (reads abandoned)."""
        if self.trailing is None or op.trailing is None:
            return None
        if not whole:
            self.trailing.cancel(op.trailing)  # type: ignore[arg-type]
            return None
        remaining = max(0.0, op.started + self._timeout(op) - time.monotonic())
        pages = self.trailing.take(op.trailing, policy, remaining)  # type: ignore[arg-type]
        return pages if self._agreed("storage trailing arrived", int(pages is not None)) else None

    def _agreed(self, tag: str, value: int) -> int:
        """``value`` (this process's) agreed with the other processes: their minimum."""
        return value if self.agreement.is_local else self.agreement.agree_min(tag, [value])[0]

    def _agreed_pages(self, tag: str, pages: int) -> int:
        """A page count agreed (``_agreed``); pages this process had beyond it are counted."""
        agreed = self._agreed(tag, pages)
        self.pages_held_back += pages - agreed
        return agreed

    def _timeout(self, op: PrefetchOp) -> float:
        return self.timeout_s if self.timeout_s is not None else 1.0 + 0.25 * len(op.tokens) / 1024

    def _alloc_guarded(self, anchor: TreeNode, n: int) -> np.ndarray | None:
        """``n`` held host slots, host eviction kept off the host-only chain ending at ``anchor``."""
        guarded: list[HostData] = []
        node = anchor
        while node is not self.tree.root and node.residency == HOST_ONLY:
            data = self.host.data(node)
            if data is not None:
                data.host_ref += 1
                guarded.append(data)
            node = node.parent
        try:
            return self.host.alloc_held(n)
        finally:
            for data in guarded:
                data.host_ref -= 1


@dataclass(frozen=True)
class StorageOptions:
    """A storage tier to link a tree's host tier to, at the tree's construction (the tree builds
    the :class:`StorageLink`: the link needs the attached host component).

    Args:
        store: the storage tier.
        host_pages: the host pool holding the pages' bytes (None: the tree makes one of the
            store's page shape, ``page_first``, whose allocator becomes the host allocator).
        prefetch_policy, prefetch_timeout_s, prefetch_threshold: as for :class:`StorageLink`.
        window: the windowed pool's store and host pool, for a tree that needs it (the hybrid
            sliding-window tree's sliding layers; ``kvjax.radix.storage_window``).
        checkpoints: the checkpoints' store and host state pool, for a tree that needs it (the
            recurrent-state tree; ``kvjax.radix.storage_checkpoint``).
    """

    store: StorageTier
    host_pages: HostPages | None = None
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float | None = None
    prefetch_threshold: int = PREFETCH_THRESHOLD
    window: WindowStore | None = None
    checkpoints: CheckpointStore | None = None
