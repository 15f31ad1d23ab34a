"""Speculative decoding under lockstep DP attention: STANDALONE drafts and EAGLE / NEXTN (the MTP layer).

SGLang serves DP attention with EAGLE / MTP (its DeepSeek-V3 deployment): every DP rank runs its own
speculative worker over its own slice of the pools, and the ranks' forwards run together. kvjax
keeps the host side per rank and the device work in one DP program per kind of step:

* **host, per rank**: each rank's ``Scheduler`` keeps its proposer (``RankDraftDecoding`` /
  ``RankEagleDecoding``: `DraftDecoding`'s and `EagleDecoding`'s checks, round allocation,
  acceptance, cut, rollback and finishing, over the rank's own allocator, request table and
  tree). Only where a proposer runs its round's device work does it differ: it hands the round's
  inputs to the lockstep front (``LockstepRank.launch_round``) instead of calling a jitted step.
* **device, one program per kind of step** (``make_dp_paired_prefill_step``,
  ``make_dp_round_step``): the single-rank bodies of ``kvjax.serve.speculative.steps`` (paired
  prefill: target then draft; round: ``k + 1`` draft steps then the verify forward) and of
  ``eagle_steps`` (with EAGLE's hidden-state store and the draft's re-run over the verified
  tokens) wrapped in a ``jax.shard_map`` over ``"data"`` exactly as ``make_dp_step`` wraps
  ``step_body``: each rank sees its own slice of the stacked pools (the draft's ``"kv_draft"``
  included, laid out as the target's: ``kvjax.dp.cache``), its own row of the stacked inputs
  and, for EAGLE, its own slice ``[num_slots, hidden]`` of the stacked store ``[dp, num_slots,
  hidden]`` (sharded over ``"data"``, replicated over the rank's ``"tp"``); ``"tp"`` stays
  automatic, both models' weights split over it (``param_sharding``), replicated over
  ``"data"``. Pools (and the store) are donated; nothing crosses ``"data"``.
* **one lockstep round** (``kvjax.dp.lockstep``): every rank with work steps its scheduler; a
  rank that prefills (a chunk, the paired prefill) hands in its batch, a rank that decodes hands in
  its speculative round. Ranks with nothing of a kind join that kind's program with an idle
  batch (``idle_round``: no sequence, its draft and verify tokens written to the trash page).
  When some ranks prefill and others run a round, the two programs run one after the other in
  the same lockstep round (prefill first, on the pools the round then reads): SGLang's DP
  attention also aligns the ranks' forward modes (its idle ranks run the forward mode of the
  others); kvjax runs both modes instead of holding a rank back.

Stacking a round: ``first_tokens [dp, S]``, the draft steps' metadata ``[dp, k + 1, ...]`` with
each step's token axis padded to the widest rank's (``kvjax.dp.attention.stack_rank_inputs``'s
padding: token 0 at position 0 on the trash page), the verify metadata as ``stack_rank_inputs``
stacks a step's. Each rank's proposals, greedy tokens and logits are those of the single-rank
round on its inputs alone (the padding tokens are read by no sequence).

Overlap scheduling (``overlap=True``; ``kvjax.serve.speculative.overlap``): each rank's proposer
launches its round ``N + 1`` before it reads round ``N`` as on one rank, but hands the chain's
inputs (``src``, ``room``, its first tokens from the host) to the lockstep front with its round
instead of chaining on its own; the DP round program (``make_dp_round_step(...,
chained_page_size=...)``) runs ``chain_round_inputs`` per rank on the previous DP round's stacked
proposals and greedy tokens, still on the device, then the rank's round. A rank's round in flight
is always the last DP round's row (a rank with a round in flight steps in the next lockstep round
and either continues it or reads it first); the front checks it. A sliding-window pool's slots
move with the full ones, as on one rank.

Recurrent-state targets (Qwen3-Next with a full-attention STANDALONE draft or its MTP layer):
a rank's proposer rolls back a round's state as `DraftDecoding` does on one rank
(``state_replay``: snapshot before the round, restore and replay the kept tokens of the requests
that rejected drafts, before any of them finishes), each step through the rank's seam: the
snapshot and restore run on the rank's slice of the stacked state pool
(``kvjax.dp.rank_state_replay``), and the replay forward (``Scheduler.replay_forward``) runs,
inside ``LockstepRank.replaying``, at once as one DP step of the rank's batch, the other ranks
joining with idle batches (``LockstepDPScheduler.replay_step``). One replay step per rejecting
rank, not one for every rank's replays: a rank settles its round inside the lockstep round's
nested steps (the last rank first) and finishes its requests right after its replay, whose
state their checkpoints copy, so no point knows every rank's kept tokens before a rank has
finished. Each replay depends on its rank's round alone and the ranks settle in their fixed
order: every process decides the same. Overlap stays off for them, as on one rank.

The ``cpu_tensor`` retraction backup copies and restores the draft's pages with the target's
on the rank's slice (``RetractionBackupExtension.in_lockstep``), as on one rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention.metadata import AttentionMetadata
from kvjax.dp.attention import _pad_tokens, stack_rank_inputs
from kvjax.dp.cache import DPKVCache, DPLayout
from kvjax.dp.rank_cache import RankKVCache
from kvjax.dp.rank_mesh import DATA_MESH_AXIS, host_sharding
from kvjax.dp.rank_state_replay import RankStateReplay, rank_state_replay
from kvjax.dp.step import rank_view
from kvjax.errors import ConfigError
from kvjax.plan.draft import DRAFT_POOL_NAME
from kvjax.serve.extension import StepBatch
from kvjax.serve.model import as_model_config, param_shapes
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import param_shardings, shard_params
from kvjax.serve.speculative.draft_decoding import DraftDecoding
from kvjax.serve.speculative.eagle import EAGLE_ALGORITHMS, EagleDecoding
from kvjax.serve.speculative.eagle_steps import eagle_prefill_body, eagle_round_body
from kvjax.serve.speculative.nextn import nextn_param_shapes
from kvjax.serve.speculative.overlap import chain_round_inputs
from kvjax.serve.speculative.proposer import draft_metadata
from kvjax.serve.speculative.steps import paired_prefill_body, round_body
from kvjax.serve.speculative.verifier import verify_metadata
from kvjax.spec import ModelSpec

if TYPE_CHECKING:
    from kvjax.serve.scheduler import Scheduler, ServingReq

__all__ = [
    "DPSpeculation",
    "RankDraft",
    "RankDraftDecoding",
    "RankEagleDecoding",
    "RoundChain",
    "RoundLauncher",
    "idle_round",
    "make_dp_paired_prefill_step",
    "make_dp_round_step",
    "rank_reports",
    "stack_rank_rounds",
]

RoundInputs = tuple[np.ndarray, AttentionMetadata, AttentionMetadata]
"""One rank's round inputs as its proposer packs them: ``(first_tokens [S], draft_metas [k + 1,
...], verify_meta)`` (``DraftDecoding.decode``)."""


@dataclasses.dataclass(frozen=True)
class RankDraft:
    """What every DP rank drafts with.

    Attributes:
        params: a STANDALONE draft model's weights, or (EAGLE / NEXTN) the MTP layer's with the
            target's embedding and head (``nextn.nextn_params``).
        num_steps: ``k``, draft tokens proposed per request per round (>= 1).
        spec: the STANDALONE draft's ``ModelSpec`` (its pool ``"kv_draft"`` is planned from it);
            None for EAGLE / NEXTN (the draft pool holds the target's MTP layer).
        config: the STANDALONE draft's serving config when it is not its spec's family default
            (a checkpoint's ``LoadedModel.config``).
    """

    params: Any
    num_steps: int
    spec: ModelSpec | None = None
    config: ModelConfig | None = None

    @property
    def eagle(self) -> bool:
        """True for the target's MTP layer (no draft model of its own)."""
        return self.spec is None and self.config is None


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _dp_program(
    body: Callable[..., tuple[Any, ...]],
    layout: DPLayout,
    weights: tuple[Any, ...],
    *,
    states: int,
    inputs: int,
    outputs: int,
) -> Any:
    """``body(pools, *states, *weights, *inputs) -> (pools, *states, *outputs)`` of one rank,
    jitted over ``layout.mesh`` for every rank at once: a ``shard_map`` with ``"data"`` manual
    (each rank its slice of the stacked pools and states, its row of the stacked inputs; the
    weights whole over ``"data"``, split over the automatic ``"tp"``), the pools and states
    donated, the outputs stacked ``[dp, ...]`` (as ``make_dp_step``)."""
    mesh = layout.mesh
    rows = P(DATA_MESH_AXIS)
    rank_def = layout.rank_pools
    n_weights = len(weights)

    def per_rank(pools: Any, *args: Any) -> tuple[Any, ...]:
        leaves, stacked_def = jax.tree_util.tree_flatten(pools)
        mine = rank_view(leaves, rank_def)
        own = tuple(x[0] for x in args[:states])
        rank_inputs = jax.tree.map(lambda x: x[0], args[states + n_weights :])
        new_pools, *rest = body(mine, *own, *args[states : states + n_weights], *rank_inputs)
        new_leaves = [x[None] for x in jax.tree_util.tree_leaves(new_pools)]
        return (jax.tree_util.tree_unflatten(stacked_def, new_leaves), *(x[None] for x in rest))

    def program(pools: Any, *args: Any) -> tuple[Any, ...]:
        run = jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=(rows, *(rows,) * states, *(P(),) * n_weights, *(rows,) * inputs),
            out_specs=(rows, *(rows,) * (states + outputs)),
            axis_names={DATA_MESH_AXIS},  # "tp" stays automatic: the pools keep their head split
            check_vma=False,
        )
        return run(pools, *args)

    pool_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.pool_specs, is_leaf=_is_spec)
    state = NamedSharding(mesh, rows)
    by_rank = host_sharding(mesh)
    return jax.jit(
        program,
        in_shardings=(pool_shardings, *(state,) * states, *weights, *(by_rank,) * inputs),
        out_shardings=(pool_shardings, *(state,) * states, *(by_rank,) * outputs),
        donate_argnums=tuple(range(1 + states)),
    )


def _weights(target: ModelConfig, draft: ModelConfig | None, layout: DPLayout) -> tuple[Any, Any]:
    """The target's and the draft's weight shardings over the DP mesh (``param_sharding``'s rules
    over ``"tp"``; the MTP layer's by the target's config when ``draft`` is None)."""
    mesh = layout.mesh
    target_weights = param_shardings(param_shapes(target), target, mesh)
    if draft is None:
        return target_weights, param_shardings(nextn_param_shapes(target), target, mesh)
    return target_weights, param_shardings(param_shapes(draft), draft, mesh)


def _with_jitted(jitted: Any) -> Callable[..., tuple[Any, ...]]:
    def step(*args: Any) -> tuple[Any, ...]:
        out: tuple[Any, ...] = jitted(*args)
        return out

    step.jitted = jitted  # type: ignore[attr-defined]
    return step


def make_dp_paired_prefill_step(
    target: ModelSpec | ModelConfig, layout: DPLayout, *, with_logits: bool, draft: ModelConfig | None = None
) -> Callable[..., tuple[Any, ...]]:
    """The paired prefill of every rank in one program (module docstring). STANDALONE (``draft``
    the draft's serving config): ``step(pools, params, draft_params, tokens [dp, T], meta) ->
    (pools, next_tokens [dp, S][, logits [dp, S, vocab]])``; EAGLE / NEXTN (``draft`` None):
    ``step(pools, store [dp, num_slots, hidden], params, draft_params, tokens, meta) -> (pools,
    store, next_tokens[, logits])``. Pools (and the store) donated; ``step.jitted`` is the jitted
    program (for ``.lower(...)``)."""
    config = as_model_config(target)
    outputs = 2 if with_logits else 1
    weights = _weights(config, draft, layout)
    if draft is None:
        body = eagle_prefill_body(config, with_logits=with_logits)
        return _with_jitted(_dp_program(body, layout, weights, states=1, inputs=2, outputs=outputs))
    body = paired_prefill_body(config, draft, with_logits=with_logits)
    return _with_jitted(_dp_program(body, layout, weights, states=0, inputs=2, outputs=outputs))


def _chained(body: Callable[..., tuple[Any, ...]], page_size: int) -> Callable[..., tuple[Any, ...]]:
    """A rank's round ``body(pools, *head, first_tokens, draft_metas, verify_meta)`` whose inputs
    are first continued from the rank's previous round on the device (``chain_round_inputs``): it
    takes ``(..., host_first, draft_metas, verify_meta, prev_proposals, prev_greedy, src, room)``."""

    def run(pools: Any, *args: Any) -> tuple[Any, ...]:
        *head, host_first, draft_metas, verify_meta, prev_proposals, prev_greedy, src, room = args
        first, draft_metas, verify_meta = chain_round_inputs(
            prev_proposals, prev_greedy, src, host_first, room, draft_metas, verify_meta, page_size=page_size
        )
        return body(pools, *head, first, draft_metas, verify_meta)

    return run


def make_dp_round_step(
    target: ModelSpec | ModelConfig,
    layout: DPLayout,
    *,
    with_logits: bool,
    draft: ModelConfig | None = None,
    chained_page_size: int | None = None,
) -> Callable[..., tuple[Any, ...]]:
    """One speculative round of every rank in one program (module docstring). STANDALONE
    (``draft`` the draft's serving config): ``round(pools, params, draft_params, first_tokens [dp,
    S], draft_metas [dp, k + 1, ...], verify_meta [dp, ...]) -> (pools, proposals [dp, S, k],
    greedy [dp, S, k + 1][, logits [dp, S, k + 1, vocab]])``; EAGLE / NEXTN (``draft`` None):
    ``round(pools, store, params, draft_params, first_tokens, draft_metas, verify_meta) -> (pools,
    store, proposals, greedy[, logits])`` (``eagle_steps``' round per rank: the chain, the verify
    forward, the draft's re-run over the verified tokens). Pools (and the store) donated;
    ``round.jitted`` is the jitted program (for ``.lower(...)``); ``k`` and the token buckets are
    read from the inputs' shapes.

    ``chained_page_size`` (the pools' page size; overlap scheduling, module docstring): every
    rank's round continues its previous one on the device; four inputs follow ``verify_meta``:
    ``prev_proposals [dp, S, k]`` and ``prev_greedy [dp, S, k + 1]`` (the previous DP round's
    outputs, as they came out), ``src`` and ``room`` int32 ``[dp, S]`` (``chain_round_inputs``'
    per rank; ``src`` -1: the row's first token is ``first_tokens``')."""
    config = as_model_config(target)
    outputs = 3 if with_logits else 2
    weights = _weights(config, draft, layout)
    states = 1 if draft is None else 0
    body = (
        eagle_round_body(config, with_logits=with_logits)
        if draft is None
        else round_body(config, draft, with_logits=with_logits)
    )
    inputs = 3
    if chained_page_size is not None:
        body, inputs = _chained(body, chained_page_size), inputs + 4
    return _with_jitted(_dp_program(body, layout, weights, states=states, inputs=inputs, outputs=outputs))


def stack_rank_rounds(rounds: Sequence[RoundInputs]) -> tuple[np.ndarray, AttentionMetadata, AttentionMetadata]:
    """Every rank's round inputs (in rank order) stacked on a leading rank axis: ``first_tokens
    [dp, S]``, the draft steps' metadata ``[dp, k + 1, ...]`` (each step's token fields padded to
    the widest rank's step) and the verify metadata (``stack_rank_inputs``). ``ValueError`` for
    ranks of different ``k`` or step shapes (``stack_rank_inputs``' checks)."""
    steps = {int(d.positions.shape[0]) for _, d, _ in rounds}
    if len(steps) != 1:
        raise ValueError(f"the ranks' rounds have {sorted(steps)} draft steps; every rank drafts the same k")
    [count] = steps
    width = max(int(d.positions.shape[1]) for _, d, _ in rounds)
    drafts = []
    for _, draft, _ in rounds:
        padded = [_pad_tokens(jax.tree.map(lambda x, j=j: np.asarray(x)[j], draft), width) for j in range(count)]
        drafts.append(jax.tree.map(lambda *xs: np.stack(xs), *padded))
    shapes = [jax.tree.map(np.shape, d) for d in drafts]
    for r, shape in enumerate(shapes[1:], start=1):
        if shape != shapes[0]:
            raise ValueError(f"rank {r}'s draft steps' shapes {shape} differ from rank 0's {shapes[0]}")
    stacked_drafts: AttentionMetadata = jax.tree.map(lambda *xs: np.stack(xs), *drafts)
    verify = [v for _, _, v in rounds]
    _, stacked_verify = stack_rank_inputs([np.zeros(v.positions.shape[0], np.int32) for v in verify], verify)
    first = np.stack([np.asarray(f, np.int32) for f, _, _ in rounds])
    return first, stacked_drafts, stacked_verify


def idle_round(scheduler: Scheduler, num_steps: int) -> RoundInputs:
    """A rank's round of no sequence, in its round's shapes: first tokens zeros, ``k + 1`` draft
    steps and a verify forward whose (padding) tokens write the trash page, with the extensions'
    metadata parts of an empty batch (as ``kvjax.dp.lockstep``'s idle batch)."""
    empty = np.zeros(0, np.int64)
    width = num_steps + 1
    slots = np.zeros((0, width), np.int32)
    drafts = draft_metadata(scheduler.metadata, empty, empty, slots, width)
    batch = StepBatch(
        rows=empty,
        starts=empty,
        seq_lens=empty,
        slots=np.zeros(0, np.int32),
        reqs=[],
        max_seqs=scheduler.max_batch_size,
        is_decode=False,
    )
    parts = [ext.step_metadata(batch) for ext in scheduler.extensions] if scheduler.extensions else []
    _, verify = verify_metadata(scheduler.metadata, empty, empty, slots, scheduler.max_batch_size, parts)
    return np.zeros(scheduler.max_batch_size, np.int32), drafts, verify


class DPSpeculation:
    """The device side of speculative decoding under lockstep DP: the two DP programs, the
    draft's weights over the DP mesh and (EAGLE) the stacked hidden-state store; the lockstep
    front calls :meth:`prefill` (its DP step) and :meth:`round`. Build it with :meth:`build`.

    Attributes:
        draft: what the ranks draft with (``RankDraft``; its params as given).
        draft_params: the draft's weights laid out over the DP mesh.
        hidden: EAGLE: the hidden-state store of every rank, ``[dp, num_slots, hidden]`` (the
            target's dtype) sharded over ``"data"``: rank ``r``'s slice is what ``EagleDecoding``
            keeps for one rank (``eagle_steps``); None for STANDALONE. Not copied by the host
            tier (as on one rank: fewer proposals accepted after a load-back, the same tokens).
    """

    def __init__(
        self,
        draft: RankDraft,
        draft_params: Any,
        prefill_step: Callable[..., tuple[Any, ...]],
        round_step: Callable[..., tuple[Any, ...]],
        hidden: jax.Array | None,
        chained_round_step: Callable[..., tuple[Any, ...]] | None = None,
    ) -> None:
        self.draft = draft
        self.draft_params = draft_params
        self.prefill_step = prefill_step
        self.round_step = round_step
        self.chained_round_step = chained_round_step
        self.hidden = hidden
        self._no_previous: tuple[jax.Array, jax.Array] | None = None

    @classmethod
    def build(
        cls, target: ModelSpec | ModelConfig, cache: DPKVCache, draft: RankDraft, *, with_logits: bool
    ) -> DPSpeculation:
        """The programs over ``cache.layout``, the draft's weights placed (split over ``"tp"`` as
        the target's), the store zeros (EAGLE). ``ConfigError`` for a cache without the draft's
        pool or planned for the other algorithm (nothing compiled)."""
        config = as_model_config(target)
        layout = cache.layout
        plan_draft = cache.plan.draft
        if plan_draft is None or DRAFT_POOL_NAME not in cache.pools:
            raise ConfigError(
                "speculative_algorithm",
                None,
                "the DP cache has no draft pool: build it with CacheConfig(speculative_algorithm=..., ...)",
            )
        eagle = plan_draft.algorithm in EAGLE_ALGORITHMS
        if eagle != draft.eagle:
            raise ConfigError(
                "speculative_algorithm",
                plan_draft.algorithm,
                "the cache's draft pool and the draft given differ: a STANDALONE draft needs its spec "
                "(RankDraft.spec) and a cache planned for STANDALONE; the MTP layer one planned for NEXTN",
            )
        draft_config = None if eagle else (draft.config or as_model_config(draft.spec))  # type: ignore[arg-type]
        placed = shard_params(draft.params, config if draft_config is None else draft_config, layout.mesh)
        prefill = make_dp_paired_prefill_step(config, layout, with_logits=with_logits, draft=draft_config)
        round_step = make_dp_round_step(config, layout, with_logits=with_logits, draft=draft_config)
        chained = make_dp_round_step(
            config, layout, with_logits=with_logits, draft=draft_config, chained_page_size=cache.plan.alloc_page_size
        )  # compiled at its first round (overlap scheduling only)
        hidden = None
        if eagle:
            slots = cache.pools[DRAFT_POOL_NAME].num_slots
            hidden = jax.device_put(
                jnp.zeros((layout.dp_size, slots, config.hidden_size), jnp.dtype(config.dtype)),
                NamedSharding(layout.mesh, P(DATA_MESH_AXIS)),
            )
        return cls(draft, placed, prefill, round_step, hidden, chained)

    @property
    def draft_config(self) -> ModelConfig | None:
        """The STANDALONE draft's serving config (None for the MTP layer)."""
        if self.draft.eagle:
            return None
        return self.draft.config or as_model_config(self.draft.spec)  # type: ignore[arg-type]

    def prefill(self, pools: Any, params: Any, tokens: Any, meta: Any) -> tuple[Any, ...]:
        """The DP step of the lockstep front (``make_dp_step``'s signature, no future tokens): the
        paired prefill of every rank, the store threaded through (EAGLE)."""
        if self.hidden is None:
            return self.prefill_step(pools, params, self.draft_params, tokens, meta)
        out = self.prefill_step(pools, self.hidden, params, self.draft_params, tokens, meta)
        self.hidden = out[1]
        return (out[0], *out[2:])

    def round(self, pools: Any, params: Any, rounds: Sequence[RoundInputs]) -> tuple[Any, ...]:
        """Every rank's round (``rounds`` in rank order, an ``idle_round`` for a rank without one)
        in one program: ``(pools, proposals [dp, S, k], greedy [dp, S, k + 1][, logits])``."""
        inputs = stack_rank_rounds(rounds)
        if self.hidden is None:
            return self.round_step(pools, params, self.draft_params, *inputs)
        out = self.round_step(pools, self.hidden, params, self.draft_params, *inputs)
        self.hidden = out[1]
        return (out[0], *out[2:])

    def chained_round(
        self,
        pools: Any,
        params: Any,
        rounds: Sequence[RoundInputs],
        previous: tuple[jax.Array, jax.Array] | None,
        src: np.ndarray,
        room: np.ndarray,
    ) -> tuple[Any, ...]:
        """Overlap scheduling: every rank's round continued on the device from its row of
        ``previous`` (the last DP round's ``(proposals [dp, S, k], greedy [dp, S, k + 1])``, unread;
        None: no rank continues one), ``src`` / ``room`` int32 ``[dp, S]`` (``chain_round_inputs``';
        ``rounds``' first tokens are the host's, read where ``src`` is -1). Outputs as :meth:`round`."""
        if self.chained_round_step is None:
            raise RuntimeError("this DPSpeculation was built without its chained round program")
        first, draft_metas, verify_meta = stack_rank_rounds(rounds)
        if previous is None:
            previous = self._zero_previous(first.shape[0], first.shape[1])
        chain = (*previous, np.asarray(src, np.int32), np.asarray(room, np.int32))
        step = self.chained_round_step
        if self.hidden is None:
            return step(pools, params, self.draft_params, first, draft_metas, verify_meta, *chain)
        out = step(pools, self.hidden, params, self.draft_params, first, draft_metas, verify_meta, *chain)
        self.hidden = out[1]
        return (out[0], *out[2:])

    def _zero_previous(self, dp: int, max_seqs: int) -> tuple[jax.Array, jax.Array]:
        """Zero ``(proposals [dp, S, k], greedy [dp, S, k + 1])`` for a round no rank continues, in
        a DP round's output layout (one compiled program for both)."""
        if self._no_previous is None:
            k = self.draft.num_steps
            mesh = jax.tree.leaves(self.draft_params)[0].sharding.mesh
            by_rank = host_sharding(mesh)
            self._no_previous = (
                jax.device_put(np.zeros((dp, max_seqs, k), np.int32), by_rank),
                jax.device_put(np.zeros((dp, max_seqs, k + 1), np.int32), by_rank),
            )
        return self._no_previous

    def proposer(self) -> DraftDecoding:
        """A rank's proposer (``RankDraftDecoding`` or ``RankEagleDecoding``), for its ``Scheduler``."""
        if self.draft.eagle:
            return RankEagleDecoding(self.draft_params, self.draft.num_steps)
        draft_config = self.draft_config
        assert draft_config is not None
        return RankDraftDecoding(draft_config, self.draft_params, self.draft.num_steps)


@runtime_checkable
class RoundLauncher(Protocol):
    """What runs a rank's speculative round under lockstep DP: ``kvjax.dp.lockstep.LockstepRank``
    (the rank's stepping), which records the round and returns the rank's outputs of the DP round."""

    def launch_round(self, inputs: tuple[Any, ...], chain: RoundChain | None = None) -> tuple[Any, ...]:
        """``(first_tokens, draft_metas, verify_meta)`` of the rank -> ``(pools, proposals,
        greedy[, logits])`` of the rank (on the host; with overlap scheduling, references to the
        rank's rows, read with ``np.asarray``). ``chain``: the round continues the rank's round in
        flight on the device (overlap scheduling, module docstring)."""
        ...

    def replaying(self) -> AbstractContextManager[None]:
        """Within it, the rank's steps are the replay of a recurrent target's kept tokens after its
        round (module docstring): each runs at once as a DP step of the rank's batch alone."""
        ...


@dataclasses.dataclass(frozen=True)
class RoundChain:
    """How a rank's round continues the rank's round in flight on the device (overlap scheduling;
    ``chain_round_inputs``' arguments of the rank).

    Attributes:
        src: int32 ``[S]``: each row's row in the round in flight, -1 for a row not in it.
        room: int32 ``[S]``: ``chain_round_inputs``' ``room``.
        proposals: the round in flight's proposals of the rank (its row of the last DP round's
            stacked output, unread), or None when no row continues it.
        greedy: likewise, its greedy tokens.
    """

    src: np.ndarray
    room: np.ndarray
    proposals: Any = None
    greedy: Any = None


def _attach_to_rank(proposer: DraftDecoding, scheduler: Scheduler) -> None:
    """A rank's proposer attached: the single-rank checks (``check_scheduler``: overlap, the
    cache's draft pool, the kinds, a retraction backup), then its round's device work handed to
    the lockstep front (a `RoundLauncher`: ``LockstepRank.launch_round``). The prefill step is
    the front's; so is a recurrent target's replay (``_replay_on_rank``)."""
    proposer.check_scheduler(scheduler)
    stepping = scheduler.stepping
    if not isinstance(stepping, RoundLauncher):
        raise TypeError(f"a rank proposer runs under lockstep DP (LockstepRank), not {type(stepping).__name__}")

    def run_round(pools: Any, params: Any, draft_params: Any, *inputs: Any) -> tuple[Any, ...]:
        first, draft_metas, verify_meta = inputs
        return stepping.launch_round((first, draft_metas, verify_meta))

    proposer._round = run_round


def _launch_chained_rank(
    scheduler: Scheduler, prev: Any, inputs: RoundInputs, src: np.ndarray, room: np.ndarray
) -> tuple[Any, ...]:
    """Overlap scheduling: a rank's round handed to the lockstep front with how it continues the
    rank's round in flight (``prev``, whose outputs are references to the rank's rows of the last
    DP round); the DP round program chains it on the device (module docstring)."""
    stepping = scheduler.stepping
    assert isinstance(stepping, RoundLauncher)  # ``_attach_to_rank`` checked it
    chain = RoundChain(src, room) if prev is None else RoundChain(src, room, prev.proposals, prev.greedy)
    return stepping.launch_round(inputs, chain)


def _rank_of(scheduler: Scheduler) -> tuple[RoundLauncher, RankStateReplay, int]:
    """A rank's launcher (its ``LockstepRank``), the DP cache's state snapshot and restore, and
    the rank's index."""
    stepping = scheduler.stepping
    assert isinstance(stepping, RoundLauncher)  # ``_attach_to_rank`` checked it
    cache = scheduler.cache
    assert isinstance(cache, RankKVCache), type(cache).__name__
    return stepping, rank_state_replay(cache.dp_cache.layout), cache.rank


def _snapshot_rank_states(scheduler: Scheduler, pools: Any, slots: np.ndarray) -> Any:
    """A recurrent target's state rows of the rank's ``slots`` before its round, out of the rank's
    slice of the stacked pool (``RankStateReplay.snapshot``; module docstring)."""
    _, replay, rank = _rank_of(scheduler)
    return replay.snapshot(pools.recurrent, rank, slots)


def _restore_rank_states(scheduler: Scheduler, pools: Any, slots: np.ndarray, saved: Any, rows: np.ndarray) -> Any:
    """``pools`` (donated) with the rank's snapshot rows ``rows`` written back at its ``slots``, in
    its slice only (``RankStateReplay.restore``)."""
    _, replay, rank = _rank_of(scheduler)
    return pools.replace(recurrent=replay.restore(pools.recurrent, rank, slots, saved, rows))


class _RankRounds(DraftDecoding):
    """What makes a proposer one DP rank's (module docstring): its rounds (chained or not) and its
    replays handed to the lockstep front, its recurrent states snapshot and restored in its slice.
    The rank proposers below take it before their one-rank proposer."""

    def attach(self, scheduler: Scheduler) -> None:
        _attach_to_rank(self, scheduler)

    def _launch_chained(
        self, s: Scheduler, pools: Any, prev: Any, inputs: RoundInputs, src: np.ndarray, room: np.ndarray
    ) -> tuple[Any, ...]:
        return _launch_chained_rank(s, prev, inputs, src, room)

    def _snapshot_states(self, s: Scheduler, pools: Any, slots: np.ndarray) -> Any:
        return _snapshot_rank_states(s, pools, slots)

    def _restore_states(self, s: Scheduler, pools: Any, slots: np.ndarray, saved: Any, rows: np.ndarray) -> Any:
        return _restore_rank_states(s, pools, slots, saved, rows)

    def _replay(
        self, s: Scheduler, running: list[ServingReq], kv_len: np.ndarray, kept: list[list[int]], saved: Any
    ) -> None:
        with _rank_of(s)[0].replaying():
            super()._replay(s, running, kv_len, kept, saved)


class RankDraftDecoding(_RankRounds):
    """`DraftDecoding` of one DP rank (STANDALONE): the rank's host side, its rounds run by the
    lockstep front's DP round (module docstring)."""


class RankEagleDecoding(_RankRounds, EagleDecoding):
    """`EagleDecoding` of one DP rank (EAGLE / NEXTN): the rank's host side, its prefills and
    rounds run by the lockstep front's DP programs, its hidden states in the rank's slice of the
    front's store (``DPSpeculation.hidden``; module docstring)."""


def rank_reports(schedulers: Sequence[Scheduler]) -> dict[str, Any] | None:
    """The ranks' speculative counters (``DraftDecoding.report``) added up, the rates over the
    sums (``acceptance_rate``: accepted over proposed; ``accept_length``: round tokens per request
    round); None when no rank drafts."""
    reports = [s.proposer.report() for s in schedulers if isinstance(s.proposer, DraftDecoding)]
    if not reports:
        return None
    total = dict(reports[0])
    for report in reports[1:]:
        for key, value in report.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("num_steps", "topk"):
                total[key] += value
    proposed, rounds = total["proposed_tokens"], total["request_rounds"]
    total["acceptance_rate"] = round(total["accepted_tokens"] / proposed, 4) if proposed else 0.0
    total["accept_length"] = round(total["round_tokens"] / rounds, 3) if rounds else 0.0
    return total
