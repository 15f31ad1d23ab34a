"""A continuous-batching loop in the shape of SGLang's scheduler, on kvjax's public API only.

Each ``step()`` runs one batch:

* **prefill** when a chunked request is in flight or requests are waiting: the chunked request
  continues first, then waiting requests are admitted in arrival order while the token budget
  (``chunked_prefill_size``), the request rows and the pool allow. Admission is
  ``match_and_lock`` (match the prefix, lock it); memory is *evict, then allocate*
  (``tree.evict`` of what is missing, then one vectorised ``alloc_extend`` for the batch). The
  last admitted request may be cut to the budget: it becomes the chunked request and is cached
  with ``cache_unfinished_req(chunked=True)`` after its chunk. A request whose prompt is done
  samples its first token, is cached with ``cache_unfinished_req`` (so later requests can share
  its prompt, as SGLang's prefill result processing does) and joins the decode batch;
* **decode** otherwise: one token for every running request via ``alloc_decode``, again after
  evicting what is missing. When even eviction cannot make room, requests are **retracted** (the
  most recently admitted first): their KV is released (``cache_finished_req(is_insert=False)``),
  their row freed, and they go back to the front of the queue with the tokens they generated,
  to be re-prefilled later.

Decode steps do not touch the tree (as in SGLang): a request's generated tokens enter it when
it finishes. A request finishes after ``max_new_tokens`` tokens or on one of its
``stop_token_ids``; ``cache_finished_req`` inserts its prompt and output into the tree and
releases its lock, and its row is freed.

Device state: the scheduler is the owner of the step (``docs/architecture.md``, "Device state:
who changes it"). Right before launching a step it applies the pending device updates the host
side recorded since the last one (host-tier loads, retraction restores, recurrent-state forks:
``KVCache.apply_pending``), in order, so the step reads them; it applies them also before each
polling step, so a load recorded by an admission that launched no step still lands. The step
function is jitted with the pools donated, and every step's new pools are handed back to the
cache the scheduler was given (``KVCache.set_pools``), so ``cache.pools`` is always the current
state, never a donated (deleted) array, and backups read the state after the step that wrote
their pages. The host reads back only the sampled tokens (and, with ``record_logits``, the logits).

Kinds of cached state beyond full attention plug into the loop as ``ServingExtension`` objects
(``extension.py``: admission, decode, release and polling hooks, and per-kind step inputs as
typed parts of the step's ``AttentionMetadata``, packed by ``kvjax.attention.MetadataBuilder``);
a full-attention cache has none.

Host time per step is split in ``ServeStats``: ``bookkeeping_seconds`` (match, evict, allocate,
table writes, cache, free: kvjax's host work), ``pack_seconds`` (page table and batch packing) and
``step_seconds`` (the jitted step until its tokens are on the host); ``finish_seconds`` is the
part of bookkeeping spent finishing requests (``cache_finished_req`` and freeing the row); the
``decode_*`` fields count decode steps only. A decode step whose new tokens all continue pages
the requests already own skips the allocator (the slot is ``last + 1``, what ``alloc_decode``
returns), finished requests free their slots in one allocator call (a free group, as SGLang),
and the running requests' lengths, rows and next input tokens are kept as arrays between decode
steps while the running set does not change (a retraction drops them: the request may come back
alone, the same object with another length), with their page table: a step in which no request
starts a page passes the last step's table to the step as it is (not with extensions, which may
rewrite their requests' table rows).
Invariant after every step: ``allocator.available_size() + tree.evictable_size() +
tree.protected_size() + tokens held by running requests outside the tree == allocator.size``;
with no request left, the last term is 0 (``leak_free``).

**Overlap scheduling** (``overlap=True``, the default; SGLang's overlap scheduler without a
thread: jax dispatches asynchronously). A decode step is launched before the host reads the
previous step's tokens, then the host reads and processes them while the new step runs, so the
device does not wait for the host's bookkeeping. The new step's input ids are the previous
step's output still on the device (``token_src`` indexes into it; ``step.py``); the host learns a
request's token one step late. Consequences, and the rules that keep them exact:

* lengths and slots do not depend on tokens: a decode step's ``kv_committed_len`` and the
  requests that reach ``max_new_tokens`` are settled when it is launched (those leave
  ``running`` then and never get a speculative step);
* a request that stops on a stop token is found one step late: the step launched meanwhile
  already computed a token for it (its KV written at one more slot). That token is dropped, the
  request's ``kv_committed_len`` goes back by one, and the extra slot is released with the
  request in the same free group: a slot that opened a new page is freed on its own, one inside
  the request's last page goes with that page (the tree's release frees the unaligned tail);
  so nothing leaks and nothing is freed twice;
* the host reads the in-flight step first (**resolves**) wherever a decision depends on its
  tokens or on the requests it finishes: before forming a prefill batch (admission reads the
  tree and the free memory that finishing requests change, so admission is the same as without
  overlap), before retracting (the choice depends on which requests continue), and when an
  extension says a request must not run ahead (``ServingExtension.can_run_ahead``: a recurrent
  state advanced by a speculative step would be donated to the tree as a wrong checkpoint);
* everything else that follows a step and needs no token (storing the pools, the extensions'
  ``after_step``, caching a prefilled prompt, window freeing, the host tier's ``poll``) runs
  as without overlap, in the same order relative to the device steps.

A proposer's speculative rounds overlap the same way, one round ahead
(``kvjax.serve.speculative.overlap``): the launched round is ``inflight_round``, read by
``resolve`` like a step, and live, resolved and retracted by the same rules.

Tokens are the same with and without overlap. ``overlap=False`` runs each step to completion
(dispatch, read the tokens, then process them) before forming the next.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import MetadataBuilder, MetadataPart
from kvjax.build import KVCache
from kvjax.errors import ConfigError, OutOfMemoryError
from kvjax.multihost.agreement import Agreement, LocalAgreement
from kvjax.plan.kinds import PlannerKind, planner_kinds_of
from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol, TreeCacheProtocol
from kvjax.request import Req
from kvjax.serve.extension import RequestAborted, ServingExtension, StepBatch
from kvjax.serve.kinds import default_extensions
from kvjax.serve.model import as_model_config
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.pool_fit import check_fits_pool, no_progress_error
from kvjax.serve.retention_clock import RetentionClock
from kvjax.serve.serving_front import serve_to_completion
from kvjax.serve.serving_req import ServingReq
from kvjax.serve.sessions import SessionTable
from kvjax.serve.stepping import OneMesh, PackedStep, Proposer, Stepping, StepRows
from kvjax.spec import ModelSpec

__all__ = ["Scheduler", "ServeStats", "ServingReq"]


@dataclasses.dataclass
class ServeStats:
    """Counters of one run. Tokens are counts over all requests; seconds are host wall time, split
    as the module docstring says (``bookkeeping + pack + step`` is the time of all steps;
    ``finish`` is part of ``bookkeeping``; ``wait`` is the part of ``step`` the host spent blocked
    reading sampled tokens; ``decode_*`` the same over scheduler steps that launched a decode)."""

    requests_finished: int = 0
    requests_aborted: int = 0  # ended unserved by an extension (``RequestAborted``)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens_computed: int = 0
    generated_tokens: int = 0
    evicted_tokens: int = 0
    retractions: int = 0
    dropped_tokens: int = 0  # overlap: speculative tokens of requests found finished one step late
    # images (``MultimodalExtension``): encoder calls and images encoded, embedding-cache lookups
    images_encoded: int = 0
    encoder_runs: int = 0
    image_cache_hits: int = 0
    image_cache_misses: int = 0
    image_cache_evictions: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    step_seconds: float = 0.0
    pack_seconds: float = 0.0
    bookkeeping_seconds: float = 0.0
    decode_step_seconds: float = 0.0
    decode_pack_seconds: float = 0.0
    decode_bookkeeping_seconds: float = 0.0
    finish_seconds: float = 0.0
    decode_finish_seconds: float = 0.0
    wait_seconds: float = 0.0
    decode_wait_seconds: float = 0.0
    peak_used_tokens: int = 0
    occupancy: list[float] = dataclasses.field(default_factory=list)
    hit_rate_history: list[float] = dataclasses.field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler:
    """Runs requests to completion on a built ``KVCache`` and a model's weights.

    Args:
        spec: the model (its layers must match the cache's pool), or its serving `ModelConfig`
            (then the config's family and dtype decide the model).
        cache: a built cache; its ``tree_cache`` decides whether prefixes are shared. The
            scheduler keeps ``cache.pools`` current (see the module docstring). A cache built over
            a mesh (``tp_size`` ranks on its ``"tp"`` axis) is served tensor-parallel: the weights
            are split Megatron style (``param_sharding``) and the step is jitted with explicit
            shardings (``step.make_sharded_step``); ``mesh`` is that mesh, else None.
        params: the model's weights (``kvjax.serve.model.init_params``, or a checkpoint's).
        max_batch_size: sequence rows per step (the step is compiled for this many).
        chunked_prefill_size: prefill token budget per step (default: the plan's, else 2048).
        record_logits: keep each output token's float32 logits on its request (``req.logits``).
        extensions: the per-kind serving hooks of the cache's other state (``extension.py``);
            default: those the cache's kinds need (none for a full-attention cache).
        overlap: overlap scheduling (see the module docstring); False runs each step to
            completion before forming the next (SGLang's ``--disable-overlap-schedule``).
        model: a model of the caller's own, run instead of the family ``spec`` names: a flax
            module whose ``apply({"params": params}, tokens, pools, meta)`` returns ``(logits,
            new_pools)`` (``kvjax.serve.step.make_module_step``); ``params`` are its weights and
            ``spec`` is then the spec the cache was planned for.
        agreement: how timing-dependent completions (host-tier transfers) are agreed with the
            other processes of a multi-process run before they change the tree
            (``kvjax.multihost``); default: one process, the identity.
        stepping: how a batch is stepped on the devices (``kvjax.serve.stepping``): ``OneMesh``
            (the default: the cache's device or mesh), ``PipelineStages``
            (``kvjax.serve.pipeline_stepping``), or a lockstep DP rank (``kvjax.dp.lockstep``).
        proposer: how decode tokens are proposed (``kvjax.serve.stepping.Proposer``): None, one
            token per request per step; ``DraftDecoding`` (``kvjax.serve.speculative``), a draft
            model's ``k`` tokens verified by the target.
        retention_clock: seconds for the tree's retention clock (``kvjax.serve.retention_clock``;
            default ``time.monotonic``), read once per step once a request asked for
            ``retention_seconds``; agreed across processes by ``agreement``.
    """

    def __init__(
        self,
        spec: ModelSpec | ModelConfig,
        cache: KVCache,
        params: dict,
        *,
        max_batch_size: int = 16,
        chunked_prefill_size: int | None = None,
        record_logits: bool = False,
        extensions: Sequence[ServingExtension] | None = None,
        overlap: bool = True,
        model: Any = None,
        agreement: Agreement | None = None,
        stepping: Stepping | None = None,
        proposer: Proposer | None = None,
        retention_clock: Callable[[], float] | None = None,
    ) -> None:
        if cache.tree_cache is None:
            raise ValueError("the cache has no tree cache: build it with build_kv_cache")
        # The family's config (None with a model of the caller's own, ``model``).
        self.model_config: ModelConfig | None = as_model_config(spec) if model is None else None
        self.spec = spec
        self.cache = cache
        self.params = params
        self.tree: TreeCacheProtocol = cache.tree_cache
        self.alloc: AllocatorProtocol = cache.allocator
        self.rows: ReqToTokenPoolProtocol = cache.req_to_token_pool
        self.page_size = self.alloc.page_size
        self.max_batch_size = min(max_batch_size, self.rows.size)
        self.budget = chunked_prefill_size or cache.plan.chunked_prefill_size or 2048
        self.metadata = MetadataBuilder(self.rows, self.page_size, self.max_batch_size)
        self.pages_per_seq = self.metadata.pages_per_seq
        self.record_logits = record_logits
        self.overlap = bool(overlap)
        self.stepping: Stepping = OneMesh() if stepping is None else stepping
        self.stepping.setup(self, spec, model)
        self.mesh = self.stepping.mesh
        self.waiting: collections.deque[ServingReq] = collections.deque()
        self.running: list[ServingReq] = []
        self.chunked: ServingReq | None = None
        self.finished: list[ServingReq] = []
        self.stats = ServeStats()
        self._admissions = 0
        self._last_logits: np.ndarray | None = None
        # The decode's running arrays, kept for the running requests (``_running_arrays``).
        self._running_cache: _RunningBatch | None = None
        self.step_page_table: np.ndarray | None = None  # the page table of the last step packed
        self._inflight: _Launched | None = None  # overlap: the launched step whose tokens are unread
        # Overlap with a proposer: its launched round whose result is unread (``RoundInFlight``).
        self.inflight_round: RoundInFlight | None = None
        # "previous tokens" of a first step (replicated over the mesh, as every step's tokens are)
        self.no_tokens = jax.device_put(
            np.zeros(self.max_batch_size, np.int32), None if self.mesh is None else NamedSharding(self.mesh, P())
        )
        # Overlap on an accelerator: start each step's token copy to the host at launch. Not on CPU,
        # where the array already is host memory and the extra copy only costs host time.
        self._copy_ahead = self.overlap and next(iter(self.no_tokens.devices())).platform != "cpu"
        self.extensions: tuple[ServingExtension, ...] = tuple(
            default_extensions(cache) if extensions is None else extensions
        )
        # The cache's kinds (``kvjax.plan.kinds``), in the kinds' order. A kind whose requests hold
        # about one window of KV whatever their length (pure sliding window) lifts the submission check.
        self.kinds: tuple[PlannerKind, ...] = planner_kinds_of(cache.plan)
        self._windowed = any(
            k.windowed_request_kv is not None and k.windowed_request_kv(cache.plan) for k in self.kinds
        )
        # Tokens promised to the requests already in the prefill batch being formed (extensions
        # that take memory at admission, such as a host tier's load-back, must leave them free).
        self.reserved_tokens = 0
        self.agreement: Agreement = agreement if agreement is not None else LocalAgreement()
        # Read once per step from the first request with retention on, agreed before the step
        # changes the tree (``retention_clock.py``); a tree without retention is never given one.
        self.retention_clock = RetentionClock(retention_clock, self.agreement)
        self._retaining = False
        for ext in self.extensions:
            ext.attach(self)
        self.proposer = proposer
        if proposer is not None:
            proposer.attach(self)
        self.sessions = SessionTable(self)

    @property
    def step_fn(self) -> Any:
        """The compiled step the stepping launches (``OneMesh``: replace it to wrap the step)."""
        return self.stepping.step_fn  # type: ignore[attr-defined]

    @step_fn.setter
    def step_fn(self, step_fn: Any) -> None:
        self.stepping.step_fn = step_fn  # type: ignore[attr-defined]

    # --- public ---------------------------------------------------------------------------------

    def submit(self, reqs: Iterable[ServingReq]) -> None:
        """Queue requests (arrival order is admission order). All or none: a request longer than
        the context (``ConfigError`` naming ``context_length``) or whose KV can never fit the pool
        (``ConfigError`` naming ``max_total_tokens``), or a session turn that cannot be taken
        (``ValueError``: ``kvjax.serve.sessions``), is refused before any is queued. A session's
        turn gets its history prepended here."""
        reqs = list(reqs)
        self.check_servable(reqs)
        for req in reqs:
            if req.retention_seconds:
                self._retaining = True
            if req.session_id is not None:
                self.sessions.begin(req)
            self.stats.prompt_tokens += req.seqlen()
            self.waiting.append(req)

    def open_session(self, session_id: str | None = None, extra_key: Hashable = None) -> str:
        """Open a session (``kvjax.serve.sessions``): its turns keep their KV between them.
        Returns its id (``session_id``, else a new one); ``extra_key``: its cache namespace."""
        return self.sessions.open(session_id, extra_key)

    def close_session(self, session_id: str) -> None:
        """Close a session: its KV is released to the tree (unlocked: evictable, still matchable),
        its row freed. ValueError while a turn of it is queued or running."""
        self.sessions.close(session_id)

    def check_servable(self, reqs: Iterable[ServingReq]) -> None:
        """Raise ``ConfigError`` for the first request this scheduler can never serve: longer than
        the context (naming ``context_length``), or whose KV can never fit the pool (naming
        ``max_total_tokens``); ``ValueError`` for a session turn that cannot be taken. A session
        turn is checked with its history. Changes nothing."""
        reqs = list(reqs)
        self.sessions.check_turns(reqs)
        for req in reqs:
            if req.session_id is not None:
                req = self.sessions.as_submitted(req)
            if req.seqlen() + req.max_new_tokens > self.rows.max_context_len:
                raise ConfigError(
                    "context_length",
                    self.rows.max_context_len - 4,
                    f"request {req.rid!r}: {req.seqlen()} prompt + {req.max_new_tokens} new tokens exceed the "
                    "context; shorten the request or raise context_length (up to the model's)",
                )
            check_fits_pool(req, self.alloc, self.page_size, windowed=self._windowed)
        if self.proposer is not None:
            self.proposer.check_servable(self, reqs)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked or self.in_flight)

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's tokens are still unread (overlap scheduling: the next
        ``step``, ``resolve`` or ``run`` reads them), or a proposer's round (``inflight_round``).
        Always False without overlap."""
        return self._inflight is not None or self.inflight_round is not None

    def live_requests(self) -> list[ServingReq]:
        """Every request that holds a row of the request table or a recurrent-state slot, each
        once: queued (after a retraction or a chunk, or waiting for state slots with its forked
        state), running, the chunked one, and (overlap) those whose in-flight step's token is
        still unread. One with a row holds its KV ``[cache_protected_len, kv_len())``,
        page-rounded, including a speculative step's slot until it is found finished: so
        ``available + evictable + protected + held == capacity`` after every step."""
        live: dict[int, ServingReq] = {}
        inflight: tuple[ServingReq, ...] = tuple(self._inflight.reqs) if self._inflight is not None else ()
        if self.inflight_round is not None:
            inflight = (*inflight, *self.inflight_round.reqs)
        chunked = (self.chunked,) if self.chunked is not None else ()
        held = self.sessions.held_requests()
        for req in (*self.running, *self.waiting, *chunked, *inflight, *held):
            if req.req_pool_idx is not None or req.mamba_pool_idx is not None:
                live[id(req)] = req
        return list(live.values())

    def step(self) -> list[ServingReq]:
        """Run one batch; return the requests that finished in it."""
        done: list[ServingReq] = []
        st = self.stats
        start = time.perf_counter()
        step_before, pack_before, finish_before = st.step_seconds, st.pack_seconds, st.finish_seconds
        wait_before = st.wait_seconds
        ran = decoded = False
        if self._retaining and hasattr(self.tree, "advance_retention_clock"):
            self.tree.advance_retention_clock(self.retention_clock.read())
        if self.chunked is not None or self.waiting:
            self.resolve(done)  # admission sees what the in-flight step finishes (module docstring)
        self.cache.apply_pending()  # updates recorded since the last launch land before polling
        for ext in self.extensions:
            ext.poll()  # after the finishing (as without overlap): transfers it started may land
        if self.chunked is not None or self.waiting:
            ran = self._prefill(done)
        if not ran and self.running:
            self._decode(done)
            ran = decoded = True
        if not ran and self.resolve(done):
            ran = True
        if not ran and (self.waiting or self.chunked):
            head = self.chunked or self.waiting[0]
            raise no_progress_error(head, len(self.waiting), self.alloc, self.rows, self.budget)
        stepped, packed = st.step_seconds - step_before, st.pack_seconds - pack_before
        bookkeeping = time.perf_counter() - start - stepped - packed
        st.bookkeeping_seconds += bookkeeping
        if decoded:
            st.decode_wait_seconds += st.wait_seconds - wait_before
            st.decode_step_seconds += stepped
            st.decode_pack_seconds += packed
            st.decode_bookkeeping_seconds += bookkeeping
            st.decode_finish_seconds += st.finish_seconds - finish_before
        available = self.alloc.available_size()
        used = self.alloc.size - available - self.tree.evictable_size()
        st.peak_used_tokens = max(st.peak_used_tokens, used)
        st.occupancy.append((self.alloc.size - available) / self.alloc.size)
        st.hit_rate_history.append(st.hit_rate)
        self.finished.extend(done)
        return done

    def resolve(self, done: list[ServingReq] | None = None) -> bool:
        """Overlap: read the in-flight step's tokens now and process them (finished requests are
        appended to ``done`` and to ``finished``); False when no step is in flight. A proposer's
        round in flight (``inflight_round``) is read and settled the same way."""
        launched = self._inflight
        if launched is None:
            round_ = self.inflight_round
            if round_ is None:
                return False
            self.inflight_round = None
            finished_round: list[ServingReq] = [] if done is None else done
            before_round = len(finished_round)
            round_.resolve(finished_round)
            if done is None:
                self.finished.extend(finished_round[before_round:])
            return True
        self._inflight = None
        finished: list[ServingReq] = [] if done is None else done
        before = len(finished)
        self._resolve_step(launched, finished, None)
        if done is None:
            self.finished.extend(finished[before:])
        return True

    def run(self, reqs: Iterable[ServingReq] = ()) -> list[ServingReq]:
        """Submit ``reqs`` and step until every request has finished; return them in finishing order."""
        return serve_to_completion(self, reqs)

    def leak_free(self) -> bool:
        """With no request left: ``available + evictable + protected == capacity`` and every row free
        (``allocator.leak_free``: a hybrid-SWA cache checks the full and the SWA side each). An
        open session that holds its KV counts as a request left: close it first."""
        return self.idle and self.alloc.leak_free(self.tree) and self.rows.available_size() == self.rows.size

    # --- memory -----------------------------------------------------------------------------------

    def make_room(self, tokens: int) -> bool:
        """Evict until ``tokens`` slots are free; True when they are (the allocator asks the tree
        for what it lacks: a hybrid-SWA allocator for each side by its own need). When eviction
        is not enough, sessions' held KV is released, one session at a time, and evicted in turn
        (before any running request is retracted: ``kvjax.serve.sessions``)."""
        while True:
            if tokens > self.alloc.available_size():
                self.stats.evicted_tokens += self.alloc.evict_to_free_tokens(self.tree, tokens)
            if self.alloc.available_size() >= tokens:
                return True
            if not self.sessions.release_one():
                return False

    def _alloc_row(self) -> int | None:
        """A free row of the request table, releasing sessions' held rows when none is free."""
        while True:
            rows = self.rows.alloc(1)
            if rows is not None:
                return int(rows[0])
            if not self.sessions.release_one():
                return None

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
            if not self.make_room(need):
                self.retract(req)
                return False
            budget -= end - start
        while self.waiting and budget > 0 and len(batch) + len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            resumed = self.sessions.resume(req)
            if resumed is not None:
                start = resumed  # the session's held KV, taken over as it is: no match
            else:
                row = self._alloc_row()
                if row is None:
                    break
                req.req_pool_idx = row
                req.kv_committed_len = None
                start = self._match_and_lock(req)
            self.reserved_tokens = need
            try:
                for ext in self.extensions if resumed is None else ():
                    ext.after_admit(req)
            except OutOfMemoryError:  # per-request state (recurrent-state slots) is short
                self._unadmit(req)
                if batch or self.running:
                    break  # it frees up as they finish: wait, as for KV
                raise  # nothing will free it: the caller sees what is short; the request stays queued
            except RequestAborted as e:  # an extension ended it (a disaggregated prefill that failed)
                self.waiting.popleft()
                self._abort(req, str(e), done)
                continue
            if self.extensions and resumed is None:
                # An extension may lengthen the match (host load-back) or restore the request's
                # own KV (retraction backup: ``kv_committed_len`` set past the tree's prefix).
                start = req.cache_protected_len if req.kv_committed_len is None else req.kv_committed_len
            end = min(req.seqlen(), start + budget)
            extra = self._pages_needed(start, end)
            if not self.make_room(need + extra):
                if resumed is not None:
                    self.sessions.unresume(req, start)
                else:
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
        batch_rows = [_row(r) for r, _, _ in batch]
        last = np.array(
            [
                self.rows.req_to_token[row, s - 1] if s else -1
                for row, s in zip(batch_rows, prefix.tolist(), strict=True)
            ]
        )
        slots = self.alloc.alloc_extend(prefix, seq, last)
        if slots is None:  # make_room guaranteed the pages; this is a bookkeeping bug
            raise RuntimeError(f"alloc_extend failed with {self.alloc.available_size()} free tokens for {need}")
        offsets = np.concatenate([[0], np.cumsum(seq - prefix)])
        for i, (row, (_, s, _)) in enumerate(zip(batch_rows, batch, strict=True)):
            self.rows.write(row, s, slots[offsets[i] : offsets[i + 1]])
        tokens = [np.asarray(req.token_range(s, e), np.int32) for req, s, e in batch]
        reqs = [r for r, _, _ in batch]
        out = self._forward(tokens, prefix, slots, np.asarray(batch_rows), seq, reqs)
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens_computed += int((seq - prefix).sum())
        if self.overlap:
            self._after_prefill_launch(batch, out, done)
            return True
        next_tokens = self._read(out, len(batch))

        for i, ((req, _, end), token) in enumerate(zip(batch, next_tokens, strict=True)):
            req.kv_committed_len = int(end)
            if end < req.seqlen():
                self.tree.cache_unfinished_req(req, chunked=True)
                self.chunked = req
                continue
            self._record_logits(req, i)
            if not self._append_token(req, int(token), done):
                # The prompt is computed: share it with later requests (SGLang's prefill result step).
                self.tree.cache_unfinished_req(req)
                self.running.append(req)
        return True

    def _after_prefill_launch(
        self, batch: list[tuple[ServingReq, int, int]], out: tuple[jax.Array, jax.Array | None], done: list[ServingReq]
    ) -> None:
        """Overlap: what follows a launched prefill step without its tokens. A request whose
        prompt is done is cached (its prompt shared) and joins ``running`` unless its first token
        is its last (``max_new_tokens`` 1); the token itself is processed when the step resolves."""
        receiving: list[ServingReq] = []
        out_rows: list[int] = []
        for i, (req, _, end) in enumerate(batch):
            req.kv_committed_len = int(end)
            if end < req.seqlen():
                self.tree.cache_unfinished_req(req, chunked=True)
                self.chunked = req
                continue
            receiving.append(req)
            out_rows.append(i)
            if len(req.output_ids) + 1 < req.max_new_tokens:
                self.tree.cache_unfinished_req(req)
                self.running.append(req)
        self._launched(_Launched(receiving, np.asarray(out_rows, np.int64), out[0], out[1]), done)

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
            self.rows.write(_row(req), 0, match.indices)
        return len(match.indices)

    def _abort(self, req: ServingReq, reason: str, done: list[ServingReq]) -> None:
        """End an admitted request unserved (``RequestAborted``): nothing of its own was computed,
        so its prefix is unlocked and nothing freed or inserted; its row is freed."""
        req.abort_reason = reason
        req.kv_committed_len = req.cache_protected_len
        for ext in self.extensions:
            ext.before_release(req, False)
        self.tree.cache_finished_req(req, is_insert=False)
        self._reset(req)
        req.finished = True
        self.stats.requests_aborted += 1
        done.append(req)

    def add_extension(self, extension: ServingExtension) -> None:
        """Run ``extension``'s hooks too, after the others (a disaggregated server's transfers);
        it is attached now."""
        self.extensions = (*self.extensions, extension)
        extension.attach(self)

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

    def _running_arrays(self) -> _RunningBatch:
        """The running requests' decode arrays (``_RunningBatch``: lengths, rows, next input tokens
        and, once a step has built it, their page table), in their order.

        Kept from the previous decode step while the running set is the same requests in the same
        order (checked by identity: the cache holds the request objects themselves, so an identity
        is never reused while it is kept), so a steady decode step reads no per-request fields.
        """
        running = self.running
        cached = self._running_cache
        if cached is not None and len(cached.reqs) == len(running) and all(map(operator.is_, cached.reqs, running)):
            return cached
        n = len(running)
        # Running requests always have kv_committed_len set (after their prefill / last decode).
        batch = _RunningBatch(
            reqs=tuple(running),
            kv_len=np.fromiter((r.kv_committed_len for r in running), np.int64, n),
            rows=np.fromiter((r.req_pool_idx for r in running), np.int64, n),
            # overlap: no tokens, they come from the device (``_input_tokens``)
            tokens=None if self.overlap else np.fromiter((r.output_ids[-1] for r in running), np.int32, n),
        )
        self._running_cache = batch
        return batch

    def _decode(self, done: list[ServingReq]) -> None:
        if self.proposer is not None:
            self.proposer.decode(self, done)
            return
        ps = self.page_size
        if self._inflight is not None and not all(ext.can_run_ahead(self.running) for ext in self.extensions):
            self._resolve_and_poll(done)
        while True:
            if not self.running:
                return
            batch = self._running_arrays()
            kv_len, rows = batch.kv_len, batch.rows
            need = int(np.count_nonzero(kv_len % ps == 0)) * ps
            if self.make_room(need):
                break
            if self._resolve_and_poll(done):  # retraction depends on which requests continue: read them first
                continue
            self.retract(self.running.pop(int(np.argmax([r.admitted_at for r in self.running]))))
        for ext in self.extensions:
            ext.before_decode(self.running)
        last = self.rows.req_to_token[rows, kv_len - 1]
        if need == 0 and ps > 1 and not getattr(self.alloc, "need_sort", False):
            # Every new token continues its request's last page, a page the request already owns:
            # the slot is last + 1, exactly what alloc_decode would return, without the call (under
            # need_sort the call may merge the release list, so it is kept there).
            slots: np.ndarray | None = (last + 1).astype(np.int32)
        else:
            slots = self.alloc.alloc_decode(kv_len + 1, last)
        if slots is None:
            raise RuntimeError(f"alloc_decode failed with {self.alloc.available_size()} free tokens for {need}")
        self.rows.req_to_token[rows, kv_len] = slots
        new_len = kv_len + 1
        # No request starts a page: the rows' pages are those of the last step, whose table is kept
        # (only without extensions: an extension may rewrite its requests' table rows).
        table = batch.page_table if need == 0 and not self.extensions else None
        if self.overlap:
            self._decode_ahead(batch, slots, new_len, table, done)
            return
        tokens = batch.tokens
        assert tokens is not None
        launched = self._forward(tokens, kv_len, slots, rows, new_len, self.running, page_table=table)
        page_table = self.step_page_table
        next_tokens = self._read(launched, len(tokens))
        st = self.stats
        st.decode_steps += 1
        st.generated_tokens += len(next_tokens)
        running, self.running = self.running, []
        logits = self._last_logits
        keep = []
        # Finished requests return their slots in one allocator call (SGLang's free group), and
        # their rows in one request-table call.
        with self.finish_group() as freed_rows:
            for i, (req, n, token) in enumerate(zip(running, new_len.tolist(), next_tokens.tolist(), strict=True)):
                req.kv_committed_len = n
                out = req.output_ids
                out.append(token)
                if logits is not None:
                    req.logits.append(logits[i])
                if len(out) < req.max_new_tokens and token not in req.stop_token_ids:
                    self.running.append(req)
                    keep.append(i)
                else:
                    self.finish(req, done, freed_rows)
        if len(keep) == len(running):
            self._running_cache = _RunningBatch(
                tuple(self.running), new_len, rows, next_tokens.astype(np.int32), page_table
            )
        else:
            idx = np.asarray(keep, np.int64)
            self._running_cache = _RunningBatch(tuple(self.running), new_len[idx], rows[idx], next_tokens[idx])

    # --- overlap ----------------------------------------------------------------------------------

    def _input_tokens(self, running: list[ServingReq]) -> tuple[np.ndarray, np.ndarray]:
        """Overlap: ``(host tokens, token_src)`` of a decode batch of ``running``: a request whose
        last token is the in-flight step's output reads it on the device (``token_src`` = its row
        in that output, host token 0), any other its last output id from the host (``-1``)."""
        n = len(running)
        prev = self._inflight
        if prev is not None and len(prev.reqs) == n and all(map(operator.is_, prev.reqs, running)):
            return np.zeros(n, np.int32), prev.out_rows.astype(np.int32)
        index = prev.index() if prev is not None else {}
        src = np.fromiter((index.get(id(r), -1) for r in running), np.int32, n)
        tokens = np.zeros(n, np.int32)
        for i in np.flatnonzero(src < 0).tolist():
            tokens[i] = running[i].output_ids[-1]
        return tokens, src

    def _resolve_and_poll(self, done: list[ServingReq]) -> bool:
        """Resolve the in-flight step, then poll the extensions, so a decision taken next sees
        the transfers the finishing started as it would without overlap (finish, poll, decide)."""
        if not self.resolve(done):
            return False
        self.cache.apply_pending()  # updates recorded since the last launch land before polling
        for ext in self.extensions:
            ext.poll()
        return True

    def _decode_ahead(
        self,
        batch: _RunningBatch,
        slots: np.ndarray,
        new_len: np.ndarray,
        page_table: np.ndarray | None,
        done: list[ServingReq],
    ) -> None:
        """Overlap: launch the decode step of ``batch`` (the running requests; ``page_table``: their
        table when it is the last step's), settle what needs no token (lengths; requests that
        reach ``max_new_tokens`` with it leave ``running``), then resolve the previous step."""
        running = self.running
        n = len(running)
        tokens, src = self._input_tokens(running)
        rows = batch.rows
        out = self._forward(tokens, batch.kv_len, slots, rows, new_len, running, token_src=src, page_table=page_table)
        table = self.step_page_table
        self.stats.decode_steps += 1
        for req, length in zip(running, new_len.tolist(), strict=True):
            req.kv_committed_len = length
        # Output tokens each request has after this step: on the host, in flight, and this one.
        outputs = batch.outputs
        if outputs is None:
            outputs = np.fromiter((len(r.output_ids) for r in running), np.int64, n) + (src >= 0)
        outputs = outputs + 1
        if batch.max_new is None:
            batch.max_new = np.fromiter((r.max_new_tokens for r in running), np.int64, n)
        max_new = batch.max_new
        going_on = outputs < max_new
        if going_on.all():
            kept = _RunningBatch(batch.reqs, new_len, rows, None, table, outputs, max_new)
        else:
            keep = np.flatnonzero(going_on)
            self.running = [running[i] for i in keep.tolist()]
            kept = _RunningBatch(
                tuple(self.running), new_len[keep], rows[keep], None, None, outputs[keep], max_new[keep]
            )
        self._running_cache = kept
        self._launched(_Launched(running, np.arange(n), out[0], out[1]), done)

    def _launched(self, launched: _Launched, done: list[ServingReq]) -> None:
        """Overlap: ``launched`` is dispatched; resolve the step before it (the host now waits for
        that one while ``launched`` is queued behind it on the device)."""
        prev, self._inflight = self._inflight, (launched if launched.reqs else None)
        if prev is not None:
            self._resolve_step(prev, done, launched)

    def _resolve_step(self, step: _Launched, done: list[ServingReq], after: _Launched | None) -> None:
        """Read ``step``'s tokens and process them: append, finish on ``max_new_tokens`` or a
        stop token. ``after``: the step launched since, whose token for a request finished here is
        speculative: dropped, and its slot released with the request (module docstring)."""
        tokens, logits = self.read_arrays(step.next_tokens, step.logits)
        st = self.stats
        ps = self.page_size
        received = tokens[step.out_rows].tolist()  # one Python int per request
        finishing: list[tuple[ServingReq, int]] = []
        dropped = 0
        for i, (req, token) in enumerate(zip(step.reqs, received, strict=True)):
            if req.finished:
                dropped += 1  # finished one step late: this was its speculative token
                continue
            out = req.output_ids
            out.append(token)
            if logits is not None:
                req.logits.append(logits[step.out_rows[i]])
            if len(out) >= req.max_new_tokens or token in req.stop_token_ids:
                finishing.append((req, i))
        st.dropped_tokens += dropped
        st.generated_tokens += len(received) - dropped
        if not finishing:
            return
        spec = after.index() if after is not None else {}
        with self.finish_group() as freed_rows:
            for req, _ in finishing:
                extra = None
                if id(req) in spec:
                    # ``after`` wrote this request's next token at slot row[kv_len - 1]: undo it.
                    assert req.kv_committed_len is not None
                    req.kv_committed_len -= 1
                    pos = req.kv_committed_len
                    if pos % ps == 0:  # it opened a page of its own; else its page is the tail's
                        extra = self.rows.req_to_token[_row(req), pos : pos + 1].copy()
                self.finish(req, done, freed_rows)
                if extra is not None:
                    self.alloc.free(extra)
        self.running = [r for r in self.running if not r.finished]

    def retract(self, req: ServingReq) -> None:
        """Release a running request's KV and requeue it (with its output) at the front."""
        if self._inflight is not None or self.inflight_round is not None:  # which requests continue must be known
            raise RuntimeError(f"retracting {req.rid!r} with a step in flight: resolve() first")
        # Last admitted, first released: a retraction backup (after the kinds) copies the request's
        # state aside before a kind's hook frees it (the recurrent state slot without a tree).
        for ext in reversed(self.extensions):
            ext.before_release(req, False)
        self.tree.cache_finished_req(req, is_insert=False)
        self._reset(req)
        # The decode's running arrays are keyed by request identity: a retracted request that is
        # re-admitted comes back as the same object with another KV length, so drop them.
        self._running_cache = None
        req.retracted += 1
        self.stats.retractions += 1
        self.waiting.appendleft(req)

    # --- shared -----------------------------------------------------------------------------------

    def _append_token(self, req: ServingReq, token: int, done: list[ServingReq]) -> bool:
        """Append a sampled token; finish the request when it is done. Returns whether it finished."""
        out = req.output_ids
        out.append(token)
        self.stats.generated_tokens += 1
        if len(out) < req.max_new_tokens and token not in req.stop_token_ids:
            return False
        self.finish(req, done)
        return True

    def forget_running_arrays(self) -> None:
        """Drop the running requests' kept decode arrays (the next decode step rebuilds them): after
        a step that changed the running requests' lengths by other means (a speculative round)."""
        self._running_cache = None

    def finish_group(self) -> _FinishGroup:
        """Finish a batch's requests together (``_finish(..., freed_rows)`` inside the ``with``):
        see ``_FinishGroup``."""
        return _FinishGroup(self.alloc, self.rows, self.stats)

    def finish(self, req: ServingReq, done: list[ServingReq], freed_rows: list[int] | None = None) -> None:
        """Cache a done request's prompt and output in the tree, unlock it, free its row (or, with
        ``freed_rows``, leave the row to the caller's one ``free`` call for the whole batch)."""
        start = time.perf_counter()
        for ext in self.extensions:
            ext.before_release(req, True)
        # A session turn that holds keeps its KV and row for the next turn; any other is released.
        if req.session_id is None or not self.sessions.finish(req):
            self.tree.cache_finished_req(req)
            if freed_rows is None:
                self.rows.free(_row(req))
            else:
                freed_rows.append(_row(req))
            req.req_pool_idx = None
        self.stats.finish_seconds += time.perf_counter() - start
        req.finished = True
        self.stats.requests_finished += 1
        done.append(req)

    def _record_logits(self, req: ServingReq, row: int) -> None:
        if self._last_logits is not None:
            req.logits.append(self._last_logits[row])

    def _forward(
        self,
        tokens: list[np.ndarray] | np.ndarray,
        starts: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        reqs: Sequence[ServingReq],
        token_src: np.ndarray | None = None,
        page_table: np.ndarray | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Run the batch on the devices (the stepping's ``forward``, which stores the new pools);
        return the sampled tokens and (``record_logits``) the logits, still on the device. The
        arguments are a ``StepRows``'s (``kvjax.serve.stepping``)."""
        return self.stepping.forward(
            self, StepRows(tokens, starts, slots, rows, seq_lens, reqs, token_src=token_src, page_table=page_table)
        )

    def replay_forward(
        self,
        tokens: list[np.ndarray],
        starts: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        reqs: Sequence[ServingReq],
    ) -> None:
        """Run the target over tokens already decided (a speculative round's kept tokens, replayed
        over the recurrent state restored from before the round: ``kvjax.serve.speculative
        .state_replay``): the step writes their KV and state like any extend and stores its pools;
        what it samples is dropped and no request changes. The arguments are ``_forward``'s."""
        self._forward(tokens, starts, slots, rows, seq_lens, reqs)

    # --- for the stepping (``kvjax.serve.stepping``) ----------------------------------------------

    def pack(
        self,
        builder: MetadataBuilder,
        step: StepRows,
        a: int,
        b: int,
        *,
        page_table: np.ndarray | None = None,
    ) -> PackedStep:
        """Rows ``a:b`` of ``step`` packed by ``builder`` (its ``max_seqs`` rows): the extensions'
        metadata parts for them and, with overlap, the future-token sources. ``page_table``: the
        rows' table when unchanged since the step it was built for."""
        starts = np.asarray(step.starts)
        rows, seq_lens = step.rows[a:b], step.seq_lens[a:b]
        if a == 0 and b == len(step.rows):
            slots = step.slots
        else:
            offsets = np.concatenate([[0], np.cumsum(np.asarray(step.seq_lens) - starts)])
            slots = step.slots[offsets[a] : offsets[b]]
        batch = None
        parts: list[MetadataPart | None] = []
        if self.extensions:
            batch = StepBatch(
                rows=rows,
                starts=starts[a:b],
                seq_lens=seq_lens,
                slots=slots,
                reqs=list(step.reqs[a:b]),
                max_seqs=builder.max_seqs,
                is_decode=step.is_decode,
            )
            parts = [ext.step_metadata(batch) for ext in self.extensions]
        flat, meta = builder.build(
            tokens=step.tokens[a:b],
            starts=starts[a:b],
            slots=slots,
            rows=rows,
            seq_lens=seq_lens,
            parts=parts,
            page_table=page_table,
        )
        src = None
        if self.overlap:
            src = np.full(flat.shape[0], -1, np.int32)
            if step.token_src is not None:
                src[: b - a] = step.token_src[a:b]
        return PackedStep(flat, meta, src, batch)

    def previous_tokens(self, first: jax.Array) -> jax.Array:
        """Overlap: the in-flight step's sampled tokens (the next step gathers its input ids from
        them), or ``first`` (zeros in the step's shape) when no step is in flight."""
        return self._inflight.next_tokens if self._inflight is not None else first

    def store_pools(self, pools: Any, stage: int = 0) -> None:
        """Hand ``pools`` (a step's result) in as the current device state of the stepping's group
        ``stage`` (what backups read from now on). The scheduler owns the step: this is the one
        place the serving loop writes device state."""
        self.stepping.states[stage].store(pools, "a step's pools")

    def after_forward(
        self, packed: Sequence[PackedStep], next_tokens: jax.Array, start: float, launched: float, end: float
    ) -> None:
        """Close a launched step: start the tokens' copy to the host (overlap on an accelerator),
        run the extensions' ``after_step`` for each packed batch and count the host time (packing
        from ``start`` to ``launched``, the dispatch to ``end``; ``_read`` adds the wait)."""
        if self._copy_ahead:
            next_tokens.copy_to_host_async()  # the tokens leave the device as soon as the step ends
        for part in packed:
            if part.batch is not None:
                for ext in self.extensions:
                    ext.after_step(part.batch)
        self.stats.pack_seconds += launched - start
        self.stats.step_seconds += end - launched

    def read_arrays(self, tokens: jax.Array, logits: jax.Array | None) -> tuple[np.ndarray, np.ndarray | None]:
        """Block until a step's tokens (and logits) are on the host; the wait counts as step time.

        ``np.asarray`` rather than ``jax.device_get``: on CPU, ``device_get`` first schedules a host
        copy (``copy_to_host_async``) and costs about 4x the host CPU time of the direct read
        (measured ~100 against ~25 us for a ready ``[64]`` array on a loaded 2-core CPU), time the
        overlapped loop takes from the step it overlaps. On an accelerator the copy is started at
        launch instead (``_forward``), so this read finds it done."""
        start = time.perf_counter()
        host_tokens = np.asarray(tokens)
        host_logits = None if logits is None else np.asarray(logits)
        waited = time.perf_counter() - start
        self.stats.step_seconds += waited
        self.stats.wait_seconds += waited
        return host_tokens, host_logits

    def _read(self, out: tuple[jax.Array, jax.Array | None], n: int) -> np.ndarray:
        """Without overlap: the step's first ``n`` sampled tokens (logits kept for ``_record_logits``)."""
        tokens, logits = self.read_arrays(*out)
        self._last_logits = None if logits is None else logits[:n]
        return tokens[:n]


class _FinishGroup:
    """The context of finishing a batch's requests together (``with ... as freed_rows``): entering
    opens the allocator's free group (SGLang's ``free_group_begin``), so the slots the finished
    requests release go back in one allocator call when it closes; ``finish`` appends their
    request-table rows to ``freed_rows``, freed on leaving in one request-table call (timed into
    ``stats.finish_seconds``). Leaving closes the group also when the body raises.

    A plain class rather than ``contextlib.contextmanager``: it runs once or twice per decode
    step, and a generator-based context costs several Python calls more each time.
    """

    __slots__ = ("_alloc", "_rows", "_stats", "freed_rows")

    def __init__(self, alloc: AllocatorProtocol, rows: ReqToTokenPoolProtocol, stats: ServeStats) -> None:
        self._alloc = alloc
        self._rows = rows
        self._stats = stats
        self.freed_rows: list[int] = []

    def __enter__(self) -> list[int]:
        self._alloc.free_group_begin()
        return self.freed_rows

    def __exit__(self, *exc_info: object) -> None:
        self._alloc.free_group_end()
        if self.freed_rows:
            start = time.perf_counter()
            self._rows.free(self.freed_rows)
            self._stats.finish_seconds += time.perf_counter() - start


class RoundInFlight(Protocol):
    """Overlap with a proposer (``kvjax.serve.speculative.overlap``): a launched speculative round
    whose result the host has not read. ``reqs``: its requests (live until it is read);
    ``resolve(done)`` reads and settles it (finished requests appended to ``done``)."""

    @property
    def reqs(self) -> Sequence[ServingReq]: ...

    def resolve(self, done: list[ServingReq]) -> None: ...


@dataclasses.dataclass
class _Launched:
    """A dispatched step whose sampled tokens the host has not read yet (overlap).

    ``reqs[i]`` receives the token in row ``out_rows[i]`` of ``next_tokens`` (``[max_seqs]``, on
    the device; ``logits`` likewise, with ``record_logits``).
    """

    reqs: list[ServingReq]
    out_rows: np.ndarray
    next_tokens: jax.Array
    logits: jax.Array | None
    _index: dict[int, int] | None = None

    def index(self) -> dict[int, int]:
        """Output row by request id."""
        if self._index is None:
            self._index = dict(zip(map(id, self.reqs), self.out_rows.tolist(), strict=True))
        return self._index


@dataclasses.dataclass
class _RunningBatch:
    """The running requests' decode arrays, kept between decode steps while the running set is the
    same requests in the same order (``Scheduler._running_arrays``).

    ``kv_len`` (int64 ``[n]``): each request's ``kv_committed_len``; ``rows`` (int64 ``[n]``): its
    request-table row; ``tokens`` (int32 ``[n]``, without overlap): its next input id.
    ``page_table``: the padded page table of ``rows`` at lengths ``kv_len`` as the last step built
    it, or None (then the next step builds it); never written after it is kept (the step may
    read the very array). Overlap: ``outputs`` (int64 ``[n]``): output tokens each request has
    on the host or in flight, None until a step sets it; ``max_new``: their ``max_new_tokens``.
    """

    reqs: tuple[ServingReq, ...]
    kv_len: np.ndarray
    rows: np.ndarray
    tokens: np.ndarray | None
    page_table: np.ndarray | None = None
    outputs: np.ndarray | None = None
    max_new: np.ndarray | None = None


def _row(req: Req) -> int:
    """The request-table row of an admitted request."""
    if req.req_pool_idx is None:
        raise RuntimeError(f"request {req.rid!r} has no request-table row; it is not admitted")
    return req.req_pool_idx
