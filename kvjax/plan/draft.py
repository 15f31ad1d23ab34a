"""The draft model of speculative decoding: what it caches and the pools it gets (pure, jax-free).

SGLang runs the draft model (EAGLE, EAGLE3, NEXTN, STANDALONE; NGRAM has none) as a second worker
that shares the target's request table and token allocator: the same slot ids index the target's
KV pool and the draft's (``draft_runner_cache_size`` is the target's token count). kvjax plans the
draft's KV as one more device pool, ``"kv_draft"``, of the target's pool kind (``"mha"`` or
``"mla"``), with the same pages and page size as the target's ``"kv"``.

Which draft:

* ``EAGLE`` / ``EAGLE3``: the draft spec given (``draft_spec``), else one decoder layer with the
  target's attention layout (heads, head dims, dtype; an MLA target gets one MLA layer);
* ``NEXTN``: the target's own ``num_nextn_predict_layers`` MTP layers, with the target's
  attention layout (SGLang's draft cell size uses ``num_nextn_predict_layers``); a ``draft_spec``
  is refused (the layers are the target's). DeepSeek's MTP layer is an MLA layer; Qwen3-Next's
  (``mtp_num_hidden_layers``, read into ``num_nextn_predict_layers``) is a full-attention layer,
  so a hybrid recurrent target's draft pool is one MHA layer of its full pool's layout beside the
  recurrent state pools (the MTP layer has no state of its own: only the target's state is
  restored and replayed after a round);
* ``STANDALONE``: a separate model, ``draft_spec`` (required to build; the plan without it
  lists no draft pool and says so in its warnings).

Sliding-window targets (hybrid SWA pools: a full pool, an SWA pool, the SWA allocator): a
``STANDALONE`` draft gets ``"kv_draft"`` of the target's layout with the allocator's pages (the
full pool's: every slot the allocator hands out is a full slot), so one slot id addresses a token
in the target's full pool, through the full→SWA mapping in its SWA pool, and in the draft's pool.
The draft may have sliding layers of its own: they read ``"kv_draft"`` masked on global positions
(as ``disable_hybrid_swa_memory`` serves a sliding model from one full-size pool), which is sound
because the full slots stay live while the request or the tree holds them. The draft's pool is
therefore not windowed (it is as large as the full pool); kvjax's choice, the simplest sound one.
SGLang sizes the draft worker of a hybrid-SWA target the same way: ``draft_runner_cache_size`` is
the target's ``max_total_num_tokens`` after ``set_num_tokens_hybrid_swa`` (the full pool's count;
``model_runner_kv_cache_mixin.py``: "Draft worker should use SWA adjusted max_total_num_tokens"),
and a draft that is itself hybrid builds its own ``SWAKVPool`` over the shared SWA allocator's
mapping. A pure sliding-window target (every layer sliding) hands out SWA slots that window
freeing returns and the allocator hands out again: its draft must slide on every layer with a
window no wider than the target's (``kvjax.plan.kinds.swa.standalone_draft``). In the budget the draft's pool is
re-split with the full layers (``kvjax.plan.kinds.swa.split_tokens``). Of the EAGLE-style drafts
of a sliding-window target only EAGLE3's is planned, as a STANDALONE draft's pool: its one
full-attention layer (the target's layout) over the allocator's slots (gpt-oss deployments serve
EAGLE3; an MTP layer or an EAGLE head of a sliding-window target is not planned yet).

Layer ids: a draft's layers are numbered as the draft model numbers them, ``0..n-1``; the NEXTN
layers follow the target's (``num_hidden_layers..``), as DeepSeek numbers its MTP layers.

Budget (kvjax's choice): the draft's bytes per token are counted with the target's when the
budget is split into tokens, so ``device_bytes <= kv_budget_bytes`` holds with the draft pool in
it. SGLang profiles the target's token count from the target's cell size alone and lets the draft
worker allocate the same token count from the memory ``mem_fraction_static`` left over; kvjax
has no second profiling pass and keeps its invariant instead (documented in
``docs/architecture.md``). Under pipeline parallelism the draft runs on the last stage only (as
SGLang's ``get_draft_kv_pool`` returns None on other stages).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.layout.pool_plan import PoolPlan
from kvjax.plan.kinds.host_tier import host_kv_pool, with_every_head_shard
from kvjax.plan.kinds.planner_kind import PlannerKind
from kvjax.plan.kinds.planning import kinds_named, kv_pool_kind_owner, layout_kind
from kvjax.plan.kinds.registry import planner_kind, planner_kinds, planner_kinds_of
from kvjax.plan.records import DraftModel, ModelKind, Target
from kvjax.spec import LayerKind, ModelSpec

if TYPE_CHECKING:
    from kvjax.plan.cache_plan import CachePlan

DRAFT_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
DRAFT_POOL_NAME = "kv_draft"
DRAFT_HOST_POOL_NAME = "host_kv_draft"


def _one_layer_draft(spec: ModelSpec, algorithm: str, kind: LayerKind, layers: int) -> ModelSpec:
    """The target's attention layout over ``layers`` layers of ``kind``, as a spec of its own."""
    return dataclasses.replace(
        spec,
        name=f"{spec.name} ({algorithm} draft)",
        num_hidden_layers=layers,
        layer_kinds=(kind,) * layers,
        sliding_window=None,
        recurrent=None,
        is_dsa=False,
        index_head_dim=None,
        num_nextn_predict_layers=0,
        warnings=(),
    )


def draft_model_spec(
    spec: ModelSpec, config: CacheConfig, draft_spec: ModelSpec | None, attention: LayerKind
) -> ModelSpec | None:
    """The spec of the draft model of ``config.speculative_algorithm`` (None without a draft
    model, or for STANDALONE without ``draft_spec``); a draft made here has ``attention`` layers
    (the target's layout's). ``ConfigError`` for a NEXTN target without MTP layers and for a
    ``draft_spec`` NEXTN cannot take."""
    algorithm = config.speculative_algorithm
    if algorithm not in DRAFT_MODEL_ALGORITHMS:
        if draft_spec is not None:
            raise ConfigError(
                "draft_spec",
                draft_spec.name,
                f"speculative_algorithm={algorithm!r} has no draft model; set EAGLE, EAGLE3 or STANDALONE, or drop it",
            )
        return None
    if algorithm == "NEXTN":
        if draft_spec is not None:
            raise ConfigError(
                "draft_spec",
                draft_spec.name,
                "NEXTN drafts with the target's own MTP layers (num_nextn_predict_layers); drop draft_spec",
            )
        if spec.num_nextn_predict_layers <= 0:
            raise ConfigError(
                "speculative_algorithm",
                algorithm,
                f"{spec.name} has no MTP layers (num_nextn_predict_layers=0); use EAGLE with a draft model",
            )
        return _one_layer_draft(spec, algorithm, attention, spec.num_nextn_predict_layers)
    if draft_spec is not None:
        return draft_spec
    if algorithm == "STANDALONE":
        return None
    return _one_layer_draft(spec, algorithm, attention, 1)


def layout_layer_kind(layout: PlannerKind) -> LayerKind:
    """The layer kind the target's layout kind caches (``PlannerKind.layer_kind``)."""
    if layout.layer_kind is None:
        raise ValueError(f"cache kind {layout.name!r} lays out the attention cache but names no layer_kind; set it")
    return LayerKind(layout.layer_kind)


def check_draft_attention(draft: ModelSpec, layout: PlannerKind, also: tuple[str, ...] = ()) -> None:
    """The draft pool is of the target's layout kind: every draft layer must cache that attention,
    or be of a layer kind in ``also`` (what the target's kind allows beside it: a sliding-window
    target's draft may slide, ``PlannerKind.standalone_draft``)."""
    want = layout_layer_kind(layout)
    allowed = {want, *(LayerKind(k) for k in also)}
    other = sorted({k.value for k in draft.layer_kinds if k not in allowed})
    if other or draft.recurrent is not None or draft.is_dsa:
        pool = layout.pool_kinds[0].name
        raise ConfigError(
            "draft_spec",
            draft.name,
            f"the draft shares the target's slots in a {pool!r} pool, whose layers are all {want.value!r}, and "
            f"this draft has {other or ['DSA indexer keys']} layers; give a draft of {want.value!r} layers only",
        )


def draft_layer_ids(spec: ModelSpec, config: CacheConfig, draft: ModelSpec) -> tuple[int, ...]:
    start = spec.num_hidden_layers if config.speculative_algorithm == "NEXTN" else 0
    return tuple(range(start, start + draft.num_hidden_layers))


def draft_pool_plans(draft: DraftModel | None, num_pages: int, host_pages: int | None) -> tuple[PoolPlan, ...]:
    """The draft's device pool ``"kv_draft"`` (``num_pages`` + the trash page, the target's
    pages) and, when ``host_pages`` is given, its host pool ``"host_kv_draft"`` with the target
    host pool's page count (host slots one to one with the target's)."""
    if draft is None or not draft.on_this_stage:
        return ()
    layout_pool = planner_kind(draft.layout_kind).layout_pool
    assert layout_pool is not None  # the draft's layout kind lays out the target's attention
    pools = [layout_pool(draft.attention, DRAFT_POOL_NAME, num_pages, draft.layer_ids)]
    if host_pages is not None:
        host = host_kv_pool(draft.attention, host_pages - 1, DRAFT_HOST_POOL_NAME, draft.layer_ids)
        pools.append(with_every_head_shard(host, draft.host_head_shards))
    return tuple(pools)


def check_draft_host_tier_buildable(plan: CachePlan) -> None:
    """``NotImplementedError`` for a host tier with a draft pool over a kind whose host pools the
    draft's is not built beside (``PlannerKind.draft_host_refusal``; every kind kvjax plans a
    draft's pool for builds it now: the draft's pages ride with the pages the allocator's slots
    index, ``kvjax.transfers.draft_pools``). ``build_kv_cache`` calls it before it allocates anything."""
    if plan.draft is None or not plan.draft.on_this_stage or not plan.attach_host_tier:
        return
    for kind in planner_kinds_of(plan):
        if kind.draft_host_refusal is not None:
            raise NotImplementedError(
                f"kvjax cannot build the host tier of {plan.model} with a {plan.draft.algorithm} draft yet: "
                f"{kind.draft_host_refusal}; turn off enable_hierarchical_cache (or speculative decoding)"
            )


def check_replay_tracking(config: CacheConfig, kind: ModelKind) -> None:
    """``ConfigError`` for speculative decoding of a kind whose state is replayed after a round
    (``PlannerKind.speculative_replay``: recurrent state) with the extra buffer's tracking at page
    boundaries under DP attention or over pipeline stages: one scheduler records only the states a
    round tracked within its kept tokens (``kvjax.serve.speculative.draft_decoding``); a DP rank's
    and the stages' rounds are not built to."""
    if config.speculative_algorithm is None or not config.enable_mamba_extra_buffer:
        return
    spread = "DP attention" if config.enable_dp_attention else "pipeline stages" if config.pp_size > 1 else None
    if spread is not None and any(k.speculative_replay for k in kinds_named(kind.cache_kinds)):
        raise ConfigError(
            "enable_mamba_extra_buffer",
            True,
            f"speculative decoding of recurrent state with the extra buffer under {spread} is not built in kvjax yet "
            "(a round's states tracked at page boundaries are recorded on one scheduler only); turn the extra buffer "
            "off (with {page_size} 1) or leave {speculative_algorithm} unset",
        )


def decide_draft(
    spec: ModelSpec, config: CacheConfig, kind: ModelKind, draft_spec: ModelSpec | None
) -> tuple[DraftModel | None, tuple[str, ...]]:
    """The draft model and its layout, or None (with a warning saying why when a draft model was
    asked for and no pool is planned). Pure; ``ConfigError`` for a draft the target's pool kind
    cannot hold."""
    from kvjax.plan.target import decide_target

    layout = layout_kind(kind)
    draft = draft_model_spec(spec, config, draft_spec, layout_layer_kind(layout))
    algorithm = config.speculative_algorithm
    check_replay_tracking(config, kind)
    if draft is None:
        if algorithm == "STANDALONE":
            return None, ("speculative_algorithm='STANDALONE' without a draft_spec: no draft KV pool is planned",)
        return None, ()
    owner = kv_pool_kind_owner(kind)
    # a kind may plan a STANDALONE (or EAGLE3) draft's pool only (the sliding window: the module docstring)
    standalone = owner.standalone_draft if algorithm in ("STANDALONE", "EAGLE3") else None
    if not (owner.plans_draft_pools or standalone is not None) or spec.is_dsa:
        planned = ", ".join(k.kv_pool_kind for k in planner_kinds() if k.kv_pool_kind and k.plans_draft_pools)
        return None, (
            f"draft KV pools for a {'DSA' if spec.is_dsa else repr(kind.kv_pool_kind)} target are not planned "
            f"(kvjax plans them for {planned} targets without DSA indexer keys, and STANDALONE drafts of "
            "sliding-window targets); build_kv_cache refuses this configuration",
        )
    check_draft_attention(draft, layout, standalone(spec, draft) if standalone is not None else ())
    draft_kind = ModelKind(str(layout.kv_pool_kind), cache_kinds=(layout.name,))
    target: Target = decide_target(draft, config, draft_kind)
    return (
        DraftModel(
            algorithm=str(algorithm),
            spec_name=draft.name,
            attention=target.attention,
            layer_ids=draft_layer_ids(spec, config, draft),
            on_this_stage=config.pp_rank == config.pp_size - 1,
            layout_kind=layout.name,
            host_head_shards=max(1, target.attn_tp_size // target.kv_head_replicas),
            kv_head_replicas=target.kv_head_replicas,
        ),
        (),
    )
