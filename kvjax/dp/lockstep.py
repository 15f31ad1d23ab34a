"""`LockstepDPScheduler`: DP attention serving, every rank's batch in one device step.

SGLang's DP attention runs the DP ranks in lockstep: every rank forms its own batch from its own
queue, tree and allocator, then one forward runs all of them (attention per rank over its own
pool slice; ranks with nothing to run join with an idle batch). Here each rank keeps a kvjax
``Scheduler`` for the host side (admission, matching, allocation, metadata, finishing, overlap
scheduling, with the serving extensions of its cache kinds), over a ``KVCache`` that shares the
rank's host objects of a ``DPKVCache`` and holds the stacked pools of all ranks.

One round, on one thread, no waiting: the front steps the first rank with work. A rank
scheduler's step function does not run the model: it records the rank's packed batch, then steps
the next rank with work, and so on (the ranks' steps nest, at most ``dp_size`` deep); a rank
whose step ends without a batch (nothing could be scheduled) just lets the next one step. Once
every active rank has handed in its batch or ended its step, the innermost call stacks the
batches (an idle batch for the other ranks), runs the one DP step (``make_dp_step``), hands every
rank's cache the new pools, and each step function returns its rank's sampled tokens (and
logits) to its scheduler, which finishes its step.

Overlap scheduling (``overlap=True``, the default; the ``Scheduler``'s rules, module docstring of
``kvjax.serve.scheduler``): every rank's scheduler runs with overlap, so a rank's decode batch
reads its input ids from the output of the step it launched last, still on the device. The
rank's step function takes that reference (``_RankTokens``: a rank's row of a DP step's stacked
``next_tokens``) with its ``token_src``; the DP step gathers ``prev_tokens[r, token_src[r, i]]``
on the device (``make_dp_step``). A rank's last launched step is always the previous DP step: a
rank with a step in flight is not idle, so it steps in the next round, and a round in which it
launches nothing resolves it. The host of a rank reads its row of the previous DP step (waits
for it) only after the next DP step is dispatched, or earlier where its rules say so (before
admitting a prefill, before retracting, when ``can_run_ahead`` says no). A stop token is found
one step late and the speculative token dropped, as with one scheduler. ``overlap=False`` runs
every DP step to completion before any rank forms its next batch.

Determinism: each rank's host work is its own scheduler's on its own objects, the ranks are
stepped in rank order and the DP step's input is the ranks' batches in rank order, so two runs
of the same stream route, batch and sample alike. Overlap changes when a rank learns of a stop
token (one round later): the ranks' loads the router reads count such a request one round longer,
so a request submitted meanwhile may be routed, hence batched, otherwise than with
``overlap=False``; the tokens are the same (every step is the single-rank step on the rank's
inputs). Across processes the stacked outputs are replicated (``host_sharding``), as the next DP
step takes its ``prev_tokens``: overlap runs there unchanged. Per-rank timing statistics
(``ServeStats.step_seconds``) of a rank include the host work of the ranks nested in its step.

Each rank's scheduler holds a ``RankKVCache`` (``kvjax.dp.rank_cache``): the rank's host
objects and its own queue of pending device updates over the DP cache's shared pools; a rank that
applies its queue hands the result to every rank and to the DP cache.

Scope: full attention, MLA, sliding window (Gemma 3, hybrid or pure; host-side serving
extensions) and recurrent state (Qwen3-Next, Nemotron-H: the ``RecurrentStateExtension`` of each
rank records its tree's state copies as updates of its own slice, ``kvjax.dp.rank_state``; the
mixers run head parallel over the rank's ``"tp"`` devices inside the DP step), the host tier
(HiCache: each rank's own host pools and tree, with the engines a one-rank cache of its kinds
composes, made over the rank's slice: ``RankPageTransferEngine`` for the KV pages, one per half
of a sliding-window pair, and ``RankStateTransferEngine`` for recurrent-state checkpoints, whose
backups read and loads write only the rank's slice, ``kvjax.dp.rank_transfer`` and
``kvjax.dp.rank_state_transfer``; its loads are recorded on the rank's own queue) and the
retraction backups (``host_pool`` through the rank's
engine, ``cpu_tensor`` through the same per-rank copies). Timing-dependent completions (a host
transfer landing) are agreed per rank through ``agreement``, as one scheduler agrees them. Other
extensions that record device updates between steps are refused.

Speculative decoding (``draft``: ``kvjax.dp.speculative``): each rank's scheduler has its
proposer, the DP step is every rank's paired prefill (target + draft) and a rank's decode hands in
its speculative round (``LockstepRank.launch_round``), run with every other rank's in one DP
round; a lockstep round in which some ranks prefill and others draft runs the DP step, then the
DP round, on the pools the step left (``mixed_rounds`` counts them). With overlap a rank's round
``N + 1`` is handed in before it reads round ``N``, with how it continues its row of the last DP
round (``RoundChain``); the DP round chains every rank's on the device. With the host tier the
draft's pages ride with the target's through each rank's engines. A recurrent target's rank
replays the kept tokens of its rejected drafts after its round (``kvjax.dp.speculative``): inside
``LockstepRank.replaying`` its step runs at once as a DP step of its batch alone, the other ranks
idle (``replay_step``), so a rank's step function returns the pools current when it returns, not
those the round's programs left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.attention.metadata_builder import MetadataBuilder
from kvjax.attention.sharding import pools_mesh
from kvjax.config import CacheConfig
from kvjax.dp.attention import stack_rank_inputs
from kvjax.dp.cache import DPKVCache, build_dp_kv_cache
from kvjax.dp.rank_cache import rank_caches
from kvjax.dp.scheduler import DPScheduler
from kvjax.dp.step import make_dp_step, place_params
from kvjax.multihost.agreement import Agreement
from kvjax.serve.dp_router import DEFAULT_MAX_LOAD_GAP_TOKENS
from kvjax.serve.extension import StepBatch
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.stepping import OneMesh, StepOwner
from kvjax.spec import ModelSpec

if TYPE_CHECKING:
    from kvjax.dp.speculative import DPSpeculation, RankDraft, RoundChain

__all__ = ["LockstepDPScheduler"]


class _Round:
    """One lockstep round: the active ranks in order, the batches handed in (tokens, metadata and,
    with overlap, the future-token reference and ``token_src``), the speculative rounds handed in
    (``kvjax.dp.speculative``), the programs' outputs (each with the pools after both)."""

    def __init__(self, active: list[int]) -> None:
        self.active = active
        self.inputs: dict[int, tuple[np.ndarray, Any, Any, np.ndarray | None]] = {}
        self.rounds: dict[int, tuple[Any, ...]] = {}
        self.chains: dict[int, RoundChain] = {}
        self.outputs: tuple[Any, ...] | None = None
        self.round_outputs: tuple[Any, ...] | None = None
        self.ran = False
        self.done: dict[int, list[ServingReq]] = {}

    def handed_in(self, rank: int) -> bool:
        return rank in self.inputs or rank in self.rounds


class LockstepRank(OneMesh):
    """The stepping of one rank's scheduler under lockstep DP (``kvjax.serve.stepping``): it packs
    the rank's batch as ``OneMesh`` does, then records it in the front's round and steps the ranks
    after it (the last one runs the DP step), and returns this rank's sampled tokens. The front
    joins it when it is built (:meth:`join`); the DP step's pools are stored by the front."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.front: LockstepDPScheduler | None = None
        self._replaying = False

    def join(self, front: LockstepDPScheduler) -> None:
        """Step this rank's batches in ``front``'s rounds."""
        self.front = front

    def setup(self, scheduler: StepOwner, spec: ModelSpec | ModelConfig, model: Any) -> None:
        """Nothing to lay out or compile: the DP step (the front's) runs every rank's batch; the
        mesh is the DP mesh (the future tokens of a first step are replicated over it)."""
        self._state = scheduler.cache.state
        self.mesh = pools_mesh(scheduler.cache.pools)

    def _current(self) -> tuple[LockstepDPScheduler, _Round]:
        front = self.front
        round_ = front._round if front is not None else None
        if front is None or round_ is None:
            raise RuntimeError(f"rank {self.rank} stepped outside a lockstep round: step the LockstepDPScheduler")
        if round_.handed_in(self.rank):
            raise RuntimeError(f"rank {self.rank} ran two batches in one lockstep round")
        return front, round_

    def launch_round(self, inputs: tuple[Any, ...], chain: RoundChain | None = None) -> tuple[Any, ...]:
        """Speculative decoding (``kvjax.dp.speculative``): record the rank's round ``(first_tokens,
        draft_metas, verify_meta)`` (with overlap, ``chain``: how it continues the rank's round in
        flight on the device), step the ranks after it (the last runs the DP programs) and return
        ``(pools, proposals [S, k], greedy [S, k + 1][, logits])`` of this rank: on the host, or
        with overlap references to the rank's rows, on the device until read."""
        front, round_ = self._current()
        round_.rounds[self.rank] = inputs
        if chain is not None:
            round_.chains[self.rank] = chain
        front._step_ranks(round_, round_.active.index(self.rank) + 1)
        if round_.round_outputs is None:
            raise RuntimeError(f"rank {self.rank}: the round ended without a DP round")
        _, *rest = round_.round_outputs
        # the pools now: a later rank may have replayed since the DP round (``replaying``)
        if front.overlap:
            return (front.cache.pools, *(_RankTokens(x, self.rank) for x in rest))
        return (front.cache.pools, *(x.host()[self.rank] for x in rest))

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Speculative decoding of a recurrent target (``kvjax.dp.speculative``): within it, the
        rank's step (the replay of its kept tokens after its round, ``Scheduler.replay_forward``)
        runs at once as a DP step of this rank's batch, every other rank joining with an idle batch
        (``LockstepDPScheduler.replay_step``), instead of being recorded in the lockstep round."""
        if self._replaying:
            raise RuntimeError(f"rank {self.rank} is already replaying")
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def launch(self, scheduler: StepOwner, pools: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        if self._replaying:
            return self._launch_replay(inputs)
        front, round_ = self._current()
        tokens, meta, *future = inputs
        prev_tokens, token_src = future if future else (None, None)
        round_.inputs[self.rank] = (tokens, meta, prev_tokens, token_src)
        front._step_ranks(round_, round_.active.index(self.rank) + 1)
        if round_.outputs is None:
            raise RuntimeError(f"rank {self.rank}: the round ended without a DP step")
        _, *rest = round_.outputs
        # the pools now: a later rank may have replayed since the DP step (``replaying``)
        if front.overlap:  # references to the rank's rows, on the device until read
            return (front.cache.pools, *(_RankTokens(x, self.rank) for x in rest))
        return (front.cache.pools, *(x.host()[self.rank] for x in rest))

    def _launch_replay(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """The rank's replay step (``replaying``), run at once: ``(pools, next_tokens[, logits])``
        of this rank, as :meth:`launch` returns them."""
        front = self.front
        if front is None or front._round is None:
            raise RuntimeError(f"rank {self.rank} replayed outside a lockstep round: step the LockstepDPScheduler")
        tokens, meta, *future = inputs
        if future and future[1] is not None and bool((np.asarray(future[1]) >= 0).any()):
            raise RuntimeError(f"rank {self.rank}'s replay reads tokens of a step in flight; its tokens are the host's")
        new_pools, *rest = front.replay_step(self.rank, tokens, meta)
        if front.overlap:
            return (new_pools, *(_RankTokens(x, self.rank) for x in rest))
        return (new_pools, *(x.host()[self.rank] for x in rest))


class _StackedOutput:
    """One DP step's stacked output (``next_tokens [dp, S]`` or ``logits``), on the device, read
    to the host once for every rank that asks (``host``)."""

    def __init__(self, array: Any) -> None:
        self.array = array
        self._host: np.ndarray | None = None

    def host(self) -> np.ndarray:
        if self._host is None:
            self._host = np.asarray(self.array)
        return self._host


class _RankTokens:
    """Overlap: rank ``rank``'s row of a DP program's stacked output, as a rank's scheduler holds
    its in-flight step's tokens (or round's proposals and greedy tokens). ``np.asarray`` reads it
    (blocking until the program is done); the next DP step takes ``stacked.array`` as its
    ``prev_tokens`` (the next DP round as its previous round's) and reads the row on the device."""

    def __init__(self, stacked: _StackedOutput, rank: int) -> None:
        self.stacked = stacked
        self.rank = rank

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        row = self.stacked.host()[self.rank]
        return row if dtype is None else row.astype(dtype)

    def copy_to_host_async(self) -> None:
        """Start the stacked output's copy to the host (an accelerator's early copy at launch)."""
        self.stacked.array.copy_to_host_async()


class LockstepDPScheduler(DPScheduler):
    """DP attention serving: the router, a host scheduler per rank, one device step for all
    (module docstring). Build it with :meth:`build_lockstep`.

    Attributes:
        cache: the ``DPKVCache`` (its ``pools`` are every rank's current device state).
        speculation: speculative decoding's device side (``kvjax.dp.speculative.DPSpeculation``:
            the paired prefill is the DP step, every rank's rounds one DP round), else None.
        dp_steps: device programs run (DP steps and DP rounds).
        mixed_rounds: lockstep rounds in which some ranks prefilled and others ran a speculative
            round (both programs ran, one after the other).
        replay_steps: DP steps that replayed one rank's kept tokens after its speculative round
            (recurrent targets; counted in ``dp_steps`` too).
    """

    def __init__(
        self,
        cache: DPKVCache,
        schedulers: list[Scheduler],
        step_fn: Any,
        params: Any,
        *,
        policy: str = "cache_aware",
        max_load_gap_tokens: int = DEFAULT_MAX_LOAD_GAP_TOKENS,
        speculation: DPSpeculation | None = None,
    ) -> None:
        super().__init__(schedulers, policy=policy, max_load_gap_tokens=max_load_gap_tokens)
        modes = {s.overlap for s in schedulers}
        if len(modes) != 1:
            raise ValueError(
                f"the rank schedulers' overlap settings {[s.overlap for s in schedulers]} differ: "
                "build every rank's Scheduler with the same overlap"
            )
        self.overlap = modes.pop()
        self.cache = cache
        self._dp_step = step_fn
        self._params = params
        self._round: _Round | None = None
        self.speculation = speculation
        self.dp_steps = 0
        self.mixed_rounds = 0
        self.replay_steps = 0
        for rank, scheduler in enumerate(schedulers):
            stepping = scheduler.stepping
            if not isinstance(stepping, LockstepRank) or stepping.rank != rank:
                raise ValueError(
                    f"rank {rank}'s scheduler is not stepped as lockstep rank {rank}: give it LockstepRank"
                )
            stepping.join(self)

    @classmethod
    def build_lockstep(
        cls,
        spec: ModelSpec,
        config: CacheConfig,
        params: dict,
        mesh: Any,
        *,
        policy: str = "cache_aware",
        max_batch_size: int = 16,
        chunked_prefill_size: int | None = None,
        record_logits: bool = False,
        max_load_gap_tokens: int = DEFAULT_MAX_LOAD_GAP_TOKENS,
        model_config: ModelConfig | None = None,
        overlap: bool = True,
        agreement: Agreement | None = None,
        draft: RankDraft | None = None,
    ) -> LockstepDPScheduler:
        """The DP cache over ``mesh`` (``build_dp_kv_cache``: ``("data", "tp")`` of
        ``(dp_size, tp_size / dp_size)`` devices; ``("data", "tp", "dcp")`` with ``dcp_size``;
        with ``pp_size`` above 1 a sequence of one such mesh per stage, ``kvjax.dp.pipeline``),
        a host scheduler per rank (``max_batch_size``,
        ``chunked_prefill_size``, ``record_logits`` as ``Scheduler`` takes them) and the DP step,
        the weights split over each rank's ``"tp"`` devices (``place_params``). ``model_config``:
        the served model's config when it is not the spec's family default (a checkpoint's,
        ``LoadedModel.config``). ``overlap``: overlap scheduling in every rank (module docstring;
        False: SGLang's ``--disable-overlap-schedule``). ``agreement``: given to every rank's
        ``Scheduler`` (with several processes, each rank's host transfers complete at the same step
        on every process, as one scheduler's do; default: this process alone). ``draft``: decode
        speculatively on every rank (``kvjax.dp.speculative``: a STANDALONE draft model with its
        spec, or the target's MTP layer; ``config`` planned with the matching
        ``speculative_algorithm``; with ``overlap`` the rounds are chained on the device).

        Raises:
            ConfigError, NotImplementedError: as ``build_dp_kv_cache`` raises them, and
                ``NotImplementedError`` for a serving extension that records device updates other
                than recurrent-state copies, the host tier's and the retraction backups' (module
                docstring), once the first rank's scheduler lists its extensions (nothing served).
        """
        served: ModelSpec | ModelConfig = spec if model_config is None else model_config
        speculation = None
        step_fn: Any
        placed: Any
        if config.pp_size > 1:  # every rank's batch through the stages (kvjax.dp.pipeline)
            from kvjax.dp.pipeline import build_dp_stages

            stages = build_dp_stages(spec, config, params, mesh, model_config=model_config, with_logits=record_logits)
            cache, step_fn, placed = stages.cache, stages, stages.params
        else:
            cache = build_dp_kv_cache(spec, config, mesh, draft_spec=None if draft is None else draft.spec)
            if draft is not None:
                from kvjax.dp.speculative import DPSpeculation

                speculation = DPSpeculation.build(served, cache, draft, with_logits=record_logits)
                step_fn = speculation.prefill  # every prefill (a chunk) is the paired prefill
            else:
                step_fn = make_dp_step(served, cache.layout, with_logits=record_logits)
            placed = place_params(served, params, cache.layout)
        schedulers = []
        shared: dict[str, Any] = {}  # what the ranks' extensions share (ServingExtension.in_lockstep)
        for view in rank_caches(cache):
            scheduler = Scheduler(
                served,
                view,
                placed,
                max_batch_size=max_batch_size,
                chunked_prefill_size=chunked_prefill_size,
                record_logits=record_logits,
                overlap=overlap,
                stepping=LockstepRank(view.rank),
                agreement=agreement,
                proposer=None if speculation is None else speculation.proposer(),
            )
            device_side = [
                type(e).__name__ for e in scheduler.extensions if not e.in_lockstep(cache.layout, view.rank, shared)
            ]
            if device_side:
                raise NotImplementedError(
                    f"lockstep DP serving of a cache with serving extensions {device_side} (they record device "
                    "updates between steps); serve it with build_kv_cache and one Scheduler per rank (DPScheduler)"
                )
            schedulers.append(scheduler)
        return cls(
            cache,
            schedulers,
            step_fn,
            placed,
            policy=policy,
            max_load_gap_tokens=max_load_gap_tokens,
            speculation=speculation,
        )

    def step(self) -> list[ServingReq]:
        """One lockstep round: every rank with work forms its batch, one DP step runs them all;
        the requests that finished, in rank order."""
        active = [r for r, s in enumerate(self.schedulers) if not s.idle]
        if not active:
            return []
        round_ = self._round = _Round(active)
        try:
            self._step_ranks(round_, 0)
        finally:
            self._round = None
        finished = [req for r in active for req in round_.done.get(r, [])]
        self.finished.extend(finished)
        return finished

    def _step_ranks(self, round_: _Round, first: int) -> None:
        """Step the active ranks from position ``first`` on. A rank whose step hands in a batch
        steps the rest itself (``LockstepRank.launch``), so this returns after that rank's step; past the
        last active rank, run the DP step."""
        for position in range(first, len(round_.active)):
            rank = round_.active[position]
            round_.done[rank] = self.schedulers[rank].step()
            if round_.handed_in(rank):
                return  # its step function stepped the ranks after it and ran the DP step
        if not round_.ran and (round_.inputs or round_.rounds):
            round_.ran = True
            if round_.inputs and round_.rounds:
                self.mixed_rounds += 1
            if round_.inputs:
                self._run_dp_step(round_)
            if round_.rounds:
                self._run_dp_round(round_)
            if round_.outputs is not None and round_.round_outputs is not None:  # both ran: the pools after both
                round_.outputs = (round_.round_outputs[0], *round_.outputs[1:])

    def _run_dp_round(self, round_: _Round) -> None:
        """Speculative decoding: every rank's handed-in round (an idle one for every other rank) in
        one DP round (``DPSpeculation.round``), on the pools the DP step (if any) left; hand every
        rank's cache the new pools."""
        speculation = self.speculation
        if speculation is None:
            raise RuntimeError(f"ranks {sorted(round_.rounds)} handed in speculative rounds to a front without a draft")
        from kvjax.dp.speculative import idle_round

        k = speculation.draft.num_steps
        rounds = [
            round_.rounds[r] if r in round_.rounds else idle_round(scheduler, k)
            for r, scheduler in enumerate(self.schedulers)
        ]
        if round_.chains:  # overlap: the ranks' rounds continue the last DP round on the device
            previous, src, room = self._round_chains(round_.chains)
            outputs = speculation.chained_round(self.cache.pools, self._params, rounds, previous, src, room)
        else:
            outputs = speculation.round(self.cache.pools, self._params, rounds)
        self.dp_steps += 1
        pools = outputs[0]
        self.schedulers[0].store_pools(pools)
        round_.round_outputs = (pools, *(_StackedOutput(x) for x in outputs[1:]))

    def _round_chains(self, chains: dict[int, RoundChain]) -> tuple[tuple[Any, Any] | None, np.ndarray, np.ndarray]:
        """The chained DP round's ``(previous, src [dp, S], room [dp, S])`` from the ranks' chains
        (a rank without one: ``src`` -1). Every rank that continues rows must continue its own row
        of one and the same DP round (module docstring); ``RuntimeError`` otherwise."""
        dp, width = len(self.schedulers), self.schedulers[0].max_batch_size
        src = np.full((dp, width), -1, np.int32)
        room = np.zeros((dp, width), np.int32)
        previous: tuple[_StackedOutput, _StackedOutput] | None = None
        for r, chain in chains.items():
            src[r, : chain.src.shape[0]] = chain.src
            room[r, : chain.room.shape[0]] = chain.room
            if not bool((chain.src >= 0).any()):
                continue
            refs = (chain.proposals, chain.greedy)
            if not all(isinstance(x, _RankTokens) and x.rank == r for x in refs):
                raise RuntimeError(f"rank {r} continues a round that is not its row of a DP round")
            stacked = (refs[0].stacked, refs[1].stacked)
            if previous is not None and stacked != previous:
                raise RuntimeError(f"rank {r} continues another DP round than an earlier rank")
            previous = stacked
        return (None if previous is None else (previous[0].array, previous[1].array)), src, room

    def _run_dp_step(self, round_: _Round) -> None:
        """The DP step of the batches handed in to ``round_`` (``_dp_step_of``)."""
        round_.outputs = self._dp_step_of(round_.inputs)

    def replay_step(self, rank: int, tokens: Any, meta: Any) -> tuple[Any, ...]:
        """Speculative decoding of a recurrent target: one DP step of rank ``rank``'s replay batch
        (its kept tokens, ``LockstepRank.replaying``), every other rank joining with an idle batch;
        its outputs as a DP step's (module docstring)."""
        if self._round is None:
            raise RuntimeError(f"rank {rank} replayed outside a lockstep round")
        outputs = self._dp_step_of({rank: (tokens, meta, None, None)})
        self.replay_steps += 1
        return outputs

    def _dp_step_of(self, inputs: dict[int, tuple[np.ndarray, Any, Any, np.ndarray | None]]) -> tuple[Any, ...]:
        """Stack the ranks' batches ``inputs`` (an idle one for every other rank), run the DP step,
        hand every rank's cache the new pools and return ``(pools, *stacked outputs)``."""
        tokens, metas, srcs = [], [], []
        prev: _StackedOutput | None = None
        for r, scheduler in enumerate(self.schedulers):
            if r in inputs:
                t, m, ref, src = inputs[r]
            else:
                (t, m), ref, src = _idle_batch(scheduler), None, None
            tokens.append(t)
            metas.append(m)
            srcs.append(src)
            if src is not None and bool((src >= 0).any()):
                if not isinstance(ref, _RankTokens):
                    raise RuntimeError(f"rank {r} reads future tokens of no DP step (got {type(ref).__name__})")
                if prev is not None and ref.stacked is not prev:
                    raise RuntimeError(f"rank {r} reads future tokens of another DP step than an earlier rank")
                if ref.rank != r:
                    raise RuntimeError(f"rank {r} reads future tokens of rank {ref.rank}'s row")
                prev = ref.stacked
        stacked_tokens, stacked_meta = stack_rank_inputs(tokens, metas)
        future: tuple[Any, ...] = ()
        if prev is not None:
            width = stacked_tokens.shape[1]
            stacked_src = np.full((len(srcs), width), -1, np.int32)
            for r, src in enumerate(srcs):
                if src is not None:
                    stacked_src[r, : src.shape[0]] = src
            future = (prev.array, stacked_src)
        outputs = self._dp_step(self.cache.pools, self._params, stacked_tokens, stacked_meta, *future)
        self.dp_steps += 1
        pools = outputs[0]
        self.schedulers[0].store_pools(pools)  # the DP cache's device state: every rank's view reads it
        return (pools, *(_StackedOutput(x) for x in outputs[1:]))


def _idle_batch(scheduler: Scheduler) -> tuple[np.ndarray, Any]:
    """A rank's batch of no sequence (padding tokens on its trash page), in its step's shapes,
    with its extensions' metadata parts (an SWA page table of zeros; recurrent state slots 0, the
    padding slot). A recurrent extension also records its tree's queued state copies here, as in
    any step: they stay in the rank's queue until its next step applies them, and the idle batch
    reads none of their slots."""
    empty = np.zeros(0, np.int32)
    batch = StepBatch(
        rows=empty,
        starts=empty,
        seq_lens=empty,
        slots=empty,
        reqs=[],
        max_seqs=scheduler.max_batch_size,
        is_decode=False,
    )
    builder = MetadataBuilder(scheduler.rows, scheduler.page_size, scheduler.max_batch_size)
    parts = [ext.step_metadata(batch) for ext in scheduler.extensions]
    return builder.build(tokens=[], starts=empty, slots=empty, rows=empty, seq_lens=empty, parts=parts)
