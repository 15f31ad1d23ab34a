"""`DraftDecoding`: speculative decoding with a draft model (SGLang's STANDALONE algorithm: a
separate, smaller draft model of the target's family, greedy verification), as the way a
`kvjax.serve.scheduler.Scheduler` proposes tokens (``Scheduler(..., proposer=DraftDecoding(...))``;
``speculative_scheduler`` builds one).

The scheduler's admission, chunked prefill, eviction, retraction and tree caching are the plain
loop's; two things differ:

* **prefill** runs the paired step (``steps.make_paired_prefill_step``): the draft model prefills
  the same tokens into its pool ``"kv_draft"`` at the same slots as the target's;
* **decode** is a speculative *round* per running request: allocate the slots of positions
  ``L .. L + k`` (``L``: the committed KV length, ``k``: ``num_steps``, SGLang's
  ``--speculative-num-steps``), let the draft propose ``k`` tokens and the target verify them in
  one jitted dispatch (``steps.make_round_step``), accept the longest agreeing prefix plus the
  target's own next token (``acceptance``), cut at ``max_new_tokens`` and stop tokens, then roll
  back: free the slots of the rejected positions (``rollback``; whole pages only: a partial page
  stays with its request). Requests that end finish as in the plain loop (their tokens cached in
  the tree, one free group).

Invariants (the plain loop's, held after every step): the draft's KV is valid wherever the
target's is (every slot either model writes, both write, with the same token), so the tree's
prefixes serve both models on a match; ``available + evictable + protected + held == capacity``
with ``held = ceil(kv_len / page_size) * page_size - cache_protected_len`` per live request; tokens
are exactly the target's greedy tokens alone (verification is greedy and the target computes every
kept token's logits over the same KV).

The draft's pool shares the target's allocator, request table and tree (``kvjax.plan.draft``), so
insert, match, eviction and retraction move both; with the host tier the draft's host pool is the
sidecar of the target's (``kvjax.transfers.draft_pools``): every backup and load-back copies both.

Over a mesh (tensor parallelism), the draft's weights are split as the target's are and both steps
are jitted with the mesh's shardings (``steps``); the draft's pool is laid out as the target's.

Sliding-window targets (hybrid SWA pools, a separate SWA allocator; or every layer sliding): the
draft's pool is indexed by the allocator's slots (``kvjax.plan.draft``), so the draft's own sliding
layers attend over it masked on global positions. The verify forward gets the extensions' step
inputs (the SWA page table and slots, translated through the full→SWA mapping) as a prefill chunk
would; the rollback's ``free`` returns each rejected slot's SWA slot with it and unpairs it; window
freeing runs before each round (``before_decode``) from the committed length, which a round only
ever moves forward, so no slot a query of the round can see (``L - W`` onwards) is freed.

Recurrent-state targets (Qwen3-Next, Nemotron-H, with a full-attention draft): the state slot is
rolled back by restoring it from before the round and replaying the kept tokens
(``state_replay``), before any request of the round finishes. With the extra buffer
(``enable_mamba_extra_buffer``: pages of more than one token, decode context parallelism's striped
page) the verify forward also tracks each request's state at the last page boundary among the
round's ``k + 1`` positions into a ping-pong slot; that state is of the request's prefix only if
the boundary lies within the tokens the round keeps, so after the replay the extensions are told
the round's kept lengths (``after_step`` of a batch cut to them) and the recurrent-state extension
records only such states. A request whose boundary lies past them is replayed, and the replay (a
forward over its kept tokens) tracks the boundary among those, if any, itself.

Overlap scheduling (``Scheduler(overlap=True)``): round ``N + 1`` is launched before the host reads
round ``N`` (``overlap``: the first tokens and the offsets by round ``N``'s accepted counts stay on
the device; each request in flight is allocated up to its host-known length plus ``2 (k + 1)``, and
the rollback frees only what the round in flight cannot use). The host reads the round in flight
first before admitting a prefill and before retracting; a sliding-window pool's slots move on the
device with the full ones; recurrent-state targets run their rounds without overlap (each read
before the next: the state replay needs the accepted counts).

A retraction backup copies and restores the draft's pages with the target's
(``kvjax.serve.retraction_extension``); one made to restore the target's pool only is refused.

Not supported (refused when the scheduler is built, naming the value): a draft whose vocabulary
differs from the target's, and a cache planned for EAGLE / EAGLE3
/ NEXTN (drafts that read the target's hidden states: ``kvjax.serve.speculative.eagle.EagleDecoding``
serves EAGLE / NEXTN with the checkpoint's MTP layer or an EAGLE head, and EAGLE3 with an EAGLE3 draft).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvjax.attention import AttentionMetadata
from kvjax.attention.sharding import serving_mesh
from kvjax.build import KVCache
from kvjax.errors import ConfigError
from kvjax.kinds.names import FULL, HOST_TIER, MLA, REQUEST_TABLE, RETRACTION, SWA
from kvjax.serve.extension import StepBatch
from kvjax.serve.model import as_model_config
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import shard_params
from kvjax.serve.pool_fit import full_pool_tokens
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative.acceptance import accepted_lengths, limit_accepted
from kvjax.serve.speculative.overlap import chain_round_inputs, no_previous_round
from kvjax.serve.speculative.proposer import draft_metadata
from kvjax.serve.speculative.rollback import rejected_slots
from kvjax.serve.speculative.state_replay import restore_states, snapshot_states
from kvjax.serve.speculative.steps import make_paired_prefill_step, make_round_step
from kvjax.serve.speculative.verifier import verify_metadata
from kvjax.spec import ModelSpec

__all__ = ["DraftDecoding", "SpeculativeStats", "speculative_scheduler"]

# The kinds whose caches chain rounds under overlap: their step inputs move on the device
# (``overlap.shift_metadata``: the base metadata and a sliding-window pool's), or they add none
# (the host tier, the retraction backup: host copies between rounds).
_CHAINED_KINDS = frozenset({FULL, MLA, SWA, REQUEST_TABLE, HOST_TIER, RETRACTION})


@dataclasses.dataclass
class SpeculativeStats:
    """Counters of the speculative rounds (``ServeStats.decode_steps`` counts the rounds too).

    ``proposed_tokens``: draft tokens proposed (``k`` per request per round); ``accepted_tokens``:
    those the target agreed with (before the cut at a request's end); ``round_tokens``: tokens the
    rounds added to outputs; ``request_rounds``: requests summed over rounds; ``rolled_back_slots``:
    slots freed for rejected tokens; ``rollback_seconds``: host time spent choosing and freeing them;
    ``replayed_requests`` / ``replayed_tokens``: requests whose recurrent state was restored and
    the tokens replayed for them (``state_replay``; zero without recurrent state);
    ``overlapped_rounds``: rounds launched before the host read the round before them, continuing
    at least one request of it on the device (``overlap``); ``dropped_request_rounds``: requests'
    rounds whose result was dropped because the round before finished the request (overlap; not
    counted in ``request_rounds`` nor ``proposed_tokens``).
    """

    rounds: int = 0
    request_rounds: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    round_tokens: int = 0
    rolled_back_slots: int = 0
    rollback_seconds: float = 0.0
    replayed_requests: int = 0
    replayed_tokens: int = 0
    overlapped_rounds: int = 0
    dropped_request_rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens per request per target verify step (SGLang's accept length, bonus token included)."""
        return self.round_tokens / self.request_rounds if self.request_rounds else 0.0


def speculative_scheduler(
    spec: ModelSpec | ModelConfig,
    cache: KVCache,
    params: dict,
    *,
    draft: ModelSpec | ModelConfig,
    draft_params: dict,
    num_steps: int,
    overlap: bool = False,
    **scheduler_args: Any,
) -> Scheduler:
    """A ``Scheduler`` that decodes speculatively with a STANDALONE draft model (``DraftDecoding``).


    Args:
        spec: the target model (its spec or serving `ModelConfig`), as for `Scheduler`.
        cache: built with ``CacheConfig(speculative_algorithm="STANDALONE", ...)`` and
            ``draft_spec`` = the draft's spec, so it has the pool ``"kv_draft"``; its request table
            must be wide enough for ``k + 1`` tokens past a request's end
            (``speculative_num_draft_tokens >= k + 1``; checked at submission).
        params: the target's weights.
        draft: the draft model's spec or serving config (``num_hidden_layers`` equal to the draft
            pool's layers, the target's vocabulary size).
        draft_params: the draft's weights.
        num_steps: ``k``, draft tokens proposed per request per round (>= 1).
        overlap: overlap scheduling of the rounds (``kvjax.serve.speculative.overlap``: round
            ``N + 1`` launched before the host reads round ``N``); False runs each to completion.
        scheduler_args: ``max_batch_size``, ``chunked_prefill_size``, ``record_logits`` (the
            target's logits of every kept token), ``extensions``: as for `Scheduler`.
    """
    proposer = DraftDecoding(draft, draft_params, num_steps)
    proposer.check_cache(spec, cache)
    return Scheduler(as_model_config(spec), cache, params, overlap=overlap, proposer=proposer, **scheduler_args)


class DraftDecoding:
    """Proposes ``num_steps`` tokens per request per round with a draft model and verifies them
    with the target (module docstring); the ``proposer`` a ``Scheduler`` is given.

    Args:
        draft: the draft model's spec or serving config.
        draft_params: the draft's weights.
        num_steps: ``k``, draft tokens proposed per request per round (>= 1).

    Attributes (after ``attach``): ``stats`` (``SpeculativeStats``), ``draft_config``.
    """

    def __init__(self, draft: ModelSpec | ModelConfig, draft_params: dict, num_steps: int) -> None:
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise ConfigError("speculative_num_steps", num_steps, "give the draft tokens per round, an integer >= 1")
        self.num_steps = num_steps
        self.draft_config = as_model_config(draft)
        self.draft_params = draft_params
        self.stats = SpeculativeStats()
        self.replays_state = False  # the cache holds recurrent state (``check_scheduler`` says)
        self.chains = False  # overlap: rounds chained on the device (``check_scheduler`` says)
        self._alloc_end: dict[int, int] = {}  # overlap: allocated positions past the committed length
        self._no_prev: tuple[Any, Any] | None = None

    def check_cache(self, spec: ModelSpec | ModelConfig, cache: KVCache) -> None:
        """``ConfigError`` / ``NotImplementedError`` naming what does not fit: a cache without the
        draft's pool, a draft algorithm other than STANDALONE, a draft of another vocabulary or of
        another layer count than the pool's."""
        plan_draft = cache.plan.draft
        if plan_draft is None or "kv_draft" not in cache.pools:
            raise ConfigError(
                "draft_spec",
                None,
                "the cache has no draft pool: build it with CacheConfig(speculative_algorithm='STANDALONE', ...) "
                "and build_kv_cache(..., draft_spec=<the draft's ModelSpec>)",
            )
        if plan_draft.algorithm != "STANDALONE":
            raise NotImplementedError(
                f"speculative_algorithm={plan_draft.algorithm!r}: DraftDecoding drafts with a STANDALONE model; "
                "drafts that read the target's hidden states (EAGLE, EAGLE3, NEXTN) are EagleDecoding's "
                "(kvjax.serve.speculative.eagle_scheduler)"
            )
        draft_config, target_config = self.draft_config, as_model_config(spec)
        if draft_config.vocab_size != target_config.vocab_size:
            raise ConfigError(
                "draft",
                draft_config.vocab_size,
                f"the draft's vocab_size must be the target's ({target_config.vocab_size}): a draft of the "
                "same family and tokenizer",
            )
        if draft_config.num_hidden_layers != plan_draft.num_layers:
            raise ConfigError(
                "draft",
                draft_config.num_hidden_layers,
                f"the draft has {draft_config.num_hidden_layers} layers and the cache's draft pool "
                f"{plan_draft.num_layers}: build the cache with this draft's spec",
            )

    def attach(self, scheduler: Scheduler) -> None:
        """Check the scheduler can decode speculatively and compile the paired prefill step (the
        scheduler's step from now on) and the round step."""
        target_config = self.check_scheduler(scheduler)
        with_logits = scheduler.record_logits
        mesh = scheduler.mesh
        pools = None
        if mesh is not None:  # tensor parallel: the draft's weights split as the target's are
            pools = scheduler.cache.pools
            self.draft_params = shard_params(self.draft_params, self.draft_config, serving_mesh(mesh))
        scheduler.step_fn = make_paired_prefill_step(
            target_config, self.draft_config, self.draft_params, with_logits=with_logits, mesh=mesh, pools=pools
        )
        self._round = make_round_step(target_config, self.draft_config, with_logits=with_logits, mesh=mesh, pools=pools)

    def check_scheduler(self, scheduler: Scheduler) -> ModelConfig:
        """The target's serving config, once ``scheduler`` is checked to decode speculatively
        (refusing by name overlap, a model of the caller's own, a cache that does not fit, state
        that cannot roll back and a retraction backup that leaves the draft's pool out)."""
        target_config = scheduler.model_config
        if target_config is None:
            raise ConfigError(
                "model", "a model of the caller's own", "speculative decoding serves the built-in families"
            )
        self.check_cache(target_config, scheduler.cache)
        other = sorted(k.name for k in scheduler.kinds if not (k.speculative_rollback or k.speculative_replay))
        if other:
            raise NotImplementedError(
                f"speculative decoding of a cache with {other} state is not served yet (rolling it back "
                "is not implemented); serve a full-attention or sliding-window model"
            )
        self.replays_state = any(k.speculative_replay for k in scheduler.kinds)
        # Overlap: rounds are chained on the device over full-attention, MLA and sliding-window
        # metadata; recurrent state (the replay needs the accepted counts on the host) resolves the
        # round before launching the next (``overlap``).
        self.chains = (
            scheduler.overlap and not self.replays_state and all(k.name in _CHAINED_KINDS for k in scheduler.kinds)
        )
        self._alloc_end = {}
        # The retraction backups restore the draft's pages with the target's (``cpu_tensor_backup``);
        # one made to copy the target's pool alone would leave a restored request's draft KV stale.
        if any(
            isinstance(ext, RetractionBackupExtension) and not ext.restores_pool("kv_draft")
            for ext in scheduler.extensions
        ):
            raise ConfigError(
                "disaggregation_decode_retraction_backup",
                "cpu_tensor",
                "this retraction backup restores the target's KV only, not the draft's ('kv_draft'): build it "
                "with retraction_extension.cpu_tensor_backup(cache, kinds.retraction_parts(cache)), or leave "
                "the backup unset",
            )
        return target_config

    def report(self) -> dict[str, Any]:
        """The rounds' counters (``SpeculativeStats``), ``num_steps``, ``acceptance_rate`` and
        ``accept_length``, as plain values (for JSON reports)."""
        stats = self.stats
        return dict(
            dataclasses.asdict(stats),
            num_steps=self.num_steps,
            acceptance_rate=round(stats.acceptance_rate, 4),
            accept_length=round(stats.accept_length, 3),
        )

    def check_servable(self, scheduler: Scheduler, reqs: Sequence[ServingReq]) -> None:
        """Room for a request's last round: it writes up to position ``seqlen + max_new_tokens - 2
        + k``, which must fit the request table (``ConfigError`` naming
        ``speculative_num_draft_tokens``) and the pool (naming ``max_total_tokens``)."""
        width = scheduler.rows.req_to_token.shape[1]
        ps = scheduler.page_size
        pool = full_pool_tokens(scheduler.alloc)
        # a pure sliding-window cache holds about one window per request, whatever its length
        windowed = any(
            k.windowed_request_kv is not None and k.windowed_request_kv(scheduler.cache.plan) for k in scheduler.kinds
        )
        for req in reqs:
            last = req.seqlen() + req.max_new_tokens - 2 + self.num_steps
            if last >= width:
                raise ConfigError(
                    "speculative_num_draft_tokens",
                    width,
                    f"request {req.rid!r}: a round writes position {last}, past the request table's {width} "
                    f"columns; build the cache with speculative_num_draft_tokens >= {self.num_steps + 1}",
                )
            peak = -(-(last + 1) // ps) * ps
            if peak > pool and not windowed:
                raise ConfigError(
                    "max_total_tokens",
                    pool,
                    f"request {req.rid!r}: its last round holds {peak} tokens of KV (prompt, output and "
                    f"{self.num_steps} draft tokens), more than the pool; raise max_total_tokens or shorten it",
                )

    # --- decode: one speculative round --------------------------------------------------------

    def decode(self, s: Scheduler, done: list[ServingReq]) -> None:
        """One speculative round of every running request (module docstring); with overlap,
        launched before the round in flight is read (``overlap``)."""
        if not s.overlap:
            self._decode_round(s, done)
            return
        if s.in_flight and not self.chains:  # not chained: read what is in flight first (module docstring)
            s.resolve(done)
        if not self.chains:
            self._decode_round(s, done)
            return
        self._decode_ahead(s, done)

    def _decode_round(self, s: Scheduler, done: list[ServingReq]) -> None:
        """One round of every running request, run to completion (no overlap)."""
        k, ps = self.num_steps, s.page_size
        width = k + 1
        while True:
            if not s.running:
                return
            kv_len = np.fromiter((r.kv_committed_len for r in s.running), np.int64, len(s.running))
            need = int(((kv_len + width + ps - 1) // ps - (kv_len + ps - 1) // ps).sum()) * ps
            if s.make_room(need):
                break
            s.retract(s.running.pop(int(np.argmax([r.admitted_at for r in s.running]))))
        for ext in s.extensions:
            ext.before_decode(s.running)
        running = s.running
        n = len(running)
        rows = np.fromiter((r.req_pool_idx for r in running), np.int64, n)
        table = s.rows.req_to_token
        last = table[rows, kv_len - 1]
        flat = s.alloc.alloc_extend(kv_len, kv_len + width, last)
        if flat is None:  # make_room guaranteed the pages; this is a bookkeeping bug
            raise RuntimeError(f"alloc_extend failed with {s.alloc.available_size()} free tokens for {need}")
        slots = np.asarray(flat).reshape(n, width)
        table[rows[:, None], kv_len[:, None] + np.arange(width)] = slots

        start = time.perf_counter()
        first = np.zeros(s.max_batch_size, np.int32)
        first[:n] = [r.output_ids[-1] for r in running]
        draft_metas = draft_metadata(s.metadata, kv_len, rows, slots, width)
        parts = []
        if s.extensions:  # the kinds' step inputs of the verify forward (the SWA page table and slots)
            batch = StepBatch(
                rows=rows,
                starts=kv_len,
                seq_lens=kv_len + width,
                slots=np.asarray(flat),
                reqs=running,
                max_seqs=s.max_batch_size,
                is_decode=False,
            )
            parts = [ext.step_metadata(batch) for ext in s.extensions]
        _, verify_meta = verify_metadata(s.metadata, kv_len, rows, slots, s.max_batch_size, parts)
        packed = time.perf_counter()
        pools = s.cache.apply_pending()  # recorded loads land before the round reads them
        saved = None
        if self.replays_state:  # the state before the round, for the requests that reject drafts
            saved = self._snapshot_states(s, pools, self._state_slots(running))
        out = self._round(pools, s.params, self.draft_params, first, draft_metas, verify_meta)
        dispatched = time.perf_counter()
        s.store_pools(out[0])
        logits_out = out[3] if s.record_logits else None
        greedy, logits = s.read_arrays(out[2], logits_out)
        proposals = np.asarray(out[1])
        s.stats.pack_seconds += packed - start
        s.stats.step_seconds += dispatched - packed
        s.stats.decode_steps += 1
        self._settle_round(s, running, kv_len, proposals[:n], greedy[:n], logits, done, saved)

    def _state_slots(self, reqs: Sequence[ServingReq]) -> np.ndarray:
        return np.asarray([r.mamba_pool_idx for r in reqs], np.int32)

    def _snapshot_states(self, s: Scheduler, pools: Any, slots: np.ndarray) -> Any:
        """The recurrent state at ``slots`` before a round (``state_replay.snapshot_states``; the
        pools only read). A lockstep DP rank's proposer snapshots its own slice instead
        (``kvjax.dp.speculative``)."""
        return snapshot_states(pools.recurrent, slots)

    def _restore_states(self, s: Scheduler, pools: Any, slots: np.ndarray, saved: Any, rows: np.ndarray) -> Any:
        """``pools`` (donated) with rows ``rows`` of ``saved`` (a ``_snapshot_states``) written back
        at ``slots`` (``state_replay.restore_states``); a lockstep DP rank's proposer writes its own
        slice instead (``kvjax.dp.speculative``)."""
        return pools.replace(recurrent=restore_states(pools.recurrent, slots, saved, rows))

    def _replay(
        self, s: Scheduler, running: list[ServingReq], kv_len: np.ndarray, kept: list[list[int]], saved: Any
    ) -> None:
        """Restore the state of each request that kept fewer than ``k + 1`` tokens and replay its
        consumed ones (``state_replay``), before any request is finished (its state is what the
        tree checkpoints)."""
        width = self.num_steps + 1
        which = [i for i, tokens in enumerate(kept) if len(tokens) < width]
        if not which:
            return
        reqs = [running[i] for i in which]
        s.store_pools(self._restore_states(s, s.cache.pools, self._state_slots(reqs), saved, np.asarray(which)))
        table = s.rows.req_to_token
        starts = kv_len[which].astype(np.int64)
        # the consumed tokens: the round's first token, then the accepted drafts
        tokens = [np.asarray([req.output_ids[-1], *kept[i][:-1]], np.int32) for i, req in zip(which, reqs, strict=True)]
        ends = starts + np.asarray([len(t) for t in tokens])
        rows = np.asarray([r.req_pool_idx for r in reqs], np.int64)
        slots = np.concatenate([table[row, a:b] for row, a, b in zip(rows, starts, ends, strict=True)])
        s.replay_forward(tokens, starts, slots, rows, ends, reqs)
        self.stats.replayed_requests += len(reqs)
        self.stats.replayed_tokens += int((ends - starts).sum())

    def _kept_after_round(
        self, s: Scheduler, running: list[ServingReq], kv_len: np.ndarray, kept: list[list[int]]
    ) -> None:
        """The extensions' ``after_step`` of the round's verify forward, as a decode batch cut to
        the tokens each request keeps (module docstring: a state the round tracked past them is of
        rejected tokens); after the replay, which tracked its own."""
        if not s.extensions:
            return
        starts = np.asarray(kv_len, np.int64)
        batch = StepBatch(
            rows=np.asarray([r.req_pool_idx for r in running], np.int64),
            starts=starts,
            seq_lens=starts + np.asarray([len(k) for k in kept], np.int64),
            slots=np.zeros(0, np.int32),
            reqs=list(running),
            max_seqs=s.max_batch_size,
            is_decode=True,
        )
        for ext in s.extensions:
            ext.after_step(batch)

    def _settle_round(
        self,
        s: Scheduler,
        running: list[ServingReq],
        kv_len: np.ndarray,
        proposals: np.ndarray,
        greedy: np.ndarray,
        logits: np.ndarray | None,
        done: list[ServingReq],
        saved: Any = None,
    ) -> None:
        """Accept, cut, roll back (the recurrent state replayed first, when the cache holds it)
        and finish (module docstring), in one free group."""
        k, ps = self.num_steps, s.page_size
        accepted = accepted_lengths(proposals, greedy)
        sp, st = self.stats, s.stats
        sp.rounds += 1
        sp.request_rounds += len(running)
        sp.proposed_tokens += k * len(running)
        sp.accepted_tokens += int(accepted.sum())
        table = s.rows.req_to_token
        kept_all = [
            limit_accepted(greedy[i, : accepted[i] + 1], req.max_new_tokens - len(req.output_ids), req.stop_token_ids)
            for i, req in enumerate(running)
        ]
        if saved is not None:
            self._replay(s, running, kv_len, kept_all, saved)
            self._kept_after_round(s, running, kv_len, kept_all)
        s.running = []
        with s.finish_group() as freed_rows:
            for i, req in enumerate(running):
                kept = kept_all[i]
                start_len = int(kv_len[i])
                new_len = start_len + len(kept)
                begin = time.perf_counter()
                rejected = rejected_slots(table[req.req_pool_idx], start_len, new_len, start_len + k + 1, ps)
                if rejected.size:
                    s.alloc.free(rejected)
                sp.rolled_back_slots += int(rejected.size)
                sp.rollback_seconds += time.perf_counter() - begin
                req.kv_committed_len = new_len
                req.output_ids.extend(kept)
                if logits is not None:
                    req.logits.extend(logits[i, : len(kept)])
                sp.round_tokens += len(kept)
                st.generated_tokens += len(kept)
                if req.done:
                    s.finish(req, done, freed_rows)
                else:
                    s.running.append(req)
        s.forget_running_arrays()

    # --- overlap: rounds chained on the device (``overlap``) -----------------------------------

    def allocated_len(self, req: ServingReq) -> int:
        """Positions of ``req``'s request-table row that hold slots it owns: its committed length,
        or (overlap) more, up to the reserve of the round in flight (``overlap``). The request holds
        ``ceil(allocated_len / page_size)`` pages beyond its protected prefix."""
        committed = req.kv_len()
        return max(committed, getattr(self, "_alloc_end", {}).get(id(req), committed))

    def _trim(self, s: Scheduler, req: ServingReq, need: int) -> None:
        """Free ``req``'s slots in whole pages past position ``need`` (what the round in flight can
        still use, or its committed length), inside the caller's free group."""
        end = self._alloc_end.get(id(req))
        if end is None:
            return
        ps = s.page_size
        keep = -(-need // ps) * ps
        if end > keep:
            begin = time.perf_counter()
            freed = np.asarray(s.rows.req_to_token[req.req_pool_idx, keep:end], np.int32)
            s.alloc.free(freed)
            self.stats.rolled_back_slots += int(freed.size)
            self.stats.rollback_seconds += time.perf_counter() - begin
            end = keep
        if end <= req.kv_len():
            del self._alloc_end[id(req)]  # nothing past the committed length: the plain accounting
        else:
            self._alloc_end[id(req)] = end

    def _decode_ahead(self, s: Scheduler, done: list[ServingReq]) -> None:
        """Overlap: launch the next round of the running requests before reading the round in
        flight, then read and settle that one (``overlap`` module docstring). A request the round
        in flight surely finishes (one token left) is left out; memory that eviction cannot give
        resolves the round in flight first, then retracts (the plain loop's order)."""
        k, ps = self.num_steps, s.page_size
        width = k + 1
        if s.in_flight and s.inflight_round is None:
            s.resolve(done)  # a prefill's first tokens: a round continues rounds only
        prev = s.inflight_round
        assert prev is None or isinstance(prev, _Round)
        while True:
            if not s.running:
                return
            index: dict[int, int] = prev.index if prev is not None else {}
            reqs = [r for r in s.running if not (id(r) in index and r.max_new_tokens - len(r.output_ids) <= 1)]
            if not reqs:
                s.resolve(done)
                prev = None
                continue
            n = len(reqs)
            kv_len = np.fromiter((r.kv_committed_len for r in reqs), np.int64, n)
            have = np.fromiter((self.allocated_len(r) for r in reqs), np.int64, n)
            in_prev = np.fromiter((id(r) in index for r in reqs), bool, n)
            cap = np.fromiter((r.seqlen() - len(r.output_ids) + r.max_new_tokens - 1 + k for r in reqs), np.int64, n)
            end = np.maximum(np.minimum(kv_len + np.where(in_prev, 2 * width, width), cap), have)
            need = int(((end + ps - 1) // ps - (have + ps - 1) // ps).sum()) * ps
            if s.make_room(need):
                break
            if prev is not None:  # which requests continue decides the retraction: read them first
                s.resolve(done)
                prev = None
                continue
            s.retract(s.running.pop(int(np.argmax([r.admitted_at for r in s.running]))))
        for ext in s.extensions:
            ext.before_decode(reqs)
        rows = np.fromiter((r.req_pool_idx for r in reqs), np.int64, n)
        table = s.rows.req_to_token
        grow = np.flatnonzero(end > have)
        if grow.size:
            start_at, end_at = have[grow], end[grow]
            flat = s.alloc.alloc_extend(start_at, end_at, table[rows[grow], start_at - 1])
            if flat is None:  # make_room guaranteed the pages; this is a bookkeeping bug
                raise RuntimeError(f"alloc_extend failed with {s.alloc.available_size()} free tokens for {need}")
            flat = np.asarray(flat)
            offsets = np.concatenate([[0], np.cumsum(end_at - start_at)])
            for j, i in enumerate(grow.tolist()):
                table[rows[i], start_at[j] : end_at[j]] = flat[offsets[j] : offsets[j + 1]]
                self._alloc_end[id(reqs[i])] = int(end_at[j])

        start = time.perf_counter()
        S = s.max_batch_size
        src = np.full(S, -1, np.int32)
        src[:n] = [index.get(id(r), -1) for r in reqs]
        room = np.zeros(S, np.int32)
        room[:n] = [r.max_new_tokens - len(r.output_ids) - 1 for r in reqs]
        host_first = np.zeros(S, np.int32)
        host_first[:n] = [r.output_ids[-1] if src[i] < 0 else 0 for i, r in enumerate(reqs)]
        slots = table[rows[:, None], kv_len[:, None] + np.arange(width)]
        page_table = s.metadata.page_tables.build(rows, end, S)
        draft_metas = draft_metadata(s.metadata, kv_len, rows, slots, width, page_table)
        parts = []
        if s.extensions:  # the kinds' verify inputs (the SWA slots), their tables over the allocated pages
            batch = StepBatch(
                rows=rows,
                starts=kv_len,
                seq_lens=end,
                slots=slots.reshape(-1),
                reqs=reqs,
                max_seqs=S,
                is_decode=False,
            )
            parts = [ext.step_metadata(batch) for ext in s.extensions]
        _, verify_meta = verify_metadata(s.metadata, kv_len, rows, slots, S, parts, page_table=page_table)
        packed = time.perf_counter()
        pools = s.cache.apply_pending()  # recorded loads land before the round reads them
        out = self._launch_chained(s, pools, prev, (host_first, draft_metas, verify_meta), src, room)
        s.store_pools(out[0])
        launched = _Round(self, s, reqs, out[1], out[2], out[3] if s.record_logits else None)
        if s._copy_ahead:  # the result leaves the device as soon as the round ends
            for array in (out[1], out[2]):
                array.copy_to_host_async()
        dispatched = time.perf_counter()
        s.stats.pack_seconds += packed - start
        s.stats.step_seconds += dispatched - packed
        s.stats.decode_steps += 1
        if (src >= 0).any():
            self.stats.overlapped_rounds += 1
        s.inflight_round = launched
        s.forget_running_arrays()
        if prev is not None:
            self._settle_ahead(s, prev, done, launched)

    def _launch_chained(
        self,
        s: Scheduler,
        pools: Any,
        prev: _Round | None,
        inputs: tuple[np.ndarray, AttentionMetadata, AttentionMetadata],
        src: np.ndarray,
        room: np.ndarray,
    ) -> tuple[Any, ...]:
        """Overlap: launch a round continued from ``prev`` (the round in flight, its result still on
        the device; None: no round before it) and return the round step's outputs, unread.

        ``inputs``: ``(host_first [S], draft_metas, verify_meta)`` built at the host-known lengths;
        ``src`` and ``room``: ``chain_round_inputs``' (int32 ``[S]``). Here the inputs are
        continued by ``chain_round_inputs`` and the round runs; a lockstep DP rank's proposer hands
        both to the DP round program instead (``kvjax.dp.speculative``)."""
        if prev is None:
            if self._no_prev is None:
                self._no_prev = no_previous_round(s.max_batch_size, self.num_steps)
            prev_proposals, prev_greedy = self._no_prev
        else:
            prev_proposals, prev_greedy = prev.proposals, prev.greedy
        host_first, draft_metas, verify_meta = inputs
        first, draft_metas, verify_meta = chain_round_inputs(
            prev_proposals, prev_greedy, src, host_first, room, draft_metas, verify_meta, page_size=s.page_size
        )
        out: tuple[Any, ...] = self._round(pools, s.params, self.draft_params, first, draft_metas, verify_meta)
        return out

    def _settle_ahead(self, s: Scheduler, launched: _Round, done: list[ServingReq], after: _Round | None) -> None:
        """Overlap: read round ``launched`` and settle it as ``_settle_round`` does (accept, cut,
        finish), its requests starting at their host-known committed lengths. A request finished
        by the round before was continued by this one on the device: its result is dropped. Each
        request keeps the slots ``after`` (the round launched since, or None) can use, and only
        those: ``L' + k + 1`` positions if ``after`` continues it, else its committed ``L'``; a
        finished request's extra slots go back with it (one free group)."""
        greedy, logits = s.read_arrays(launched.greedy, launched.logits)
        reqs = launched.reqs
        n = len(reqs)
        proposals = np.asarray(launched.proposals)[:n]
        greedy = greedy[:n]
        k = self.num_steps
        accepted = accepted_lengths(proposals, greedy)
        sp, st = self.stats, s.stats
        following = after.index if after is not None else {}
        with s.finish_group() as freed_rows:
            for i, req in enumerate(reqs):
                if req.finished:
                    sp.dropped_request_rounds += 1
                    continue
                room = req.max_new_tokens - len(req.output_ids)
                kept = limit_accepted(greedy[i, : accepted[i] + 1], room, req.stop_token_ids)
                sp.request_rounds += 1
                sp.proposed_tokens += k
                sp.accepted_tokens += int(accepted[i])
                sp.round_tokens += len(kept)
                st.generated_tokens += len(kept)
                assert req.kv_committed_len is not None
                new_len = req.kv_committed_len + len(kept)
                req.kv_committed_len = new_len
                req.output_ids.extend(kept)
                if logits is not None:
                    req.logits.extend(logits[i, : len(kept)])
                if req.done:
                    self._trim(s, req, new_len)
                    self._alloc_end.pop(id(req), None)
                    s.finish(req, done, freed_rows)
                else:
                    self._trim(s, req, new_len + k + 1 if id(req) in following else new_len)
        sp.rounds += 1
        s.running = [r for r in s.running if not r.finished]
        s.forget_running_arrays()


class _Round:
    """Overlap: a launched round whose result the host has not read (the scheduler's
    ``inflight_round``). ``reqs[i]``'s proposals and greedy tokens are row ``i`` of ``proposals``
    (int32 ``[B, k]``) and ``greedy`` (int32 ``[S, k + 1]``), on the device; ``logits`` likewise,
    with ``record_logits``; ``index``: row by request identity."""

    __slots__ = ("greedy", "index", "logits", "proposals", "proposer", "reqs", "scheduler")

    def __init__(
        self,
        proposer: DraftDecoding,
        scheduler: Scheduler,
        reqs: list[ServingReq],
        proposals: Any,
        greedy: Any,
        logits: Any,
    ) -> None:
        self.proposer = proposer
        self.scheduler = scheduler
        self.reqs = reqs
        self.proposals = proposals
        self.greedy = greedy
        self.logits = logits
        self.index = {id(r): i for i, r in enumerate(reqs)}

    def resolve(self, done: list[ServingReq]) -> None:
        """Read and settle the round, nothing launched after it (``Scheduler.resolve``)."""
        self.proposer._settle_ahead(self.scheduler, self, done, None)
