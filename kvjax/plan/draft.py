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
  is refused (the layers are the target's);
* ``STANDALONE``: a separate model, ``draft_spec`` (required to build; the plan without it
  lists no draft pool and says so in its warnings).

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
from dataclasses import dataclass

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.plan.records import ModelKind, Target
from kvjax.pools.mha_layout import MHALayout
from kvjax.pools.mla_layout import MLALayout
from kvjax.pools.pool_plan import PoolPlan
from kvjax.pools.registry import is_built
from kvjax.spec import LayerKind, ModelSpec

DRAFT_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
DRAFT_POOL_NAME = "kv_draft"
DRAFT_HOST_POOL_NAME = "host_kv_draft"
DRAFT_POOL_KINDS = ("mha", "mla", "hybrid_linear")  # the target KV pool kinds a draft pool is planned for


@dataclass(frozen=True)
class DraftModel:
    """What the draft model caches, per rank.

    ``attention``: the draft pool's layout (the target's pool kind); ``layer_ids``: the draft's
    layer ids (see the module docstring); ``on_this_stage``: this pipeline rank holds the draft
    (the last one).
    """

    algorithm: str
    spec_name: str
    attention: MHALayout | MLALayout
    layer_ids: tuple[int, ...]
    on_this_stage: bool

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token over every draft layer, on the stage that holds the draft (the last:
        every stage's sizing needs it, since the token count is the minimum over stages)."""
        return self.num_layers * self.attention.bytes_per_token_per_layer


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


def draft_model_spec(spec: ModelSpec, config: CacheConfig, draft_spec: ModelSpec | None) -> ModelSpec | None:
    """The spec of the draft model of ``config.speculative_algorithm`` (None without a draft
    model, or for STANDALONE without ``draft_spec``). ``ConfigError`` for a NEXTN target without
    MTP layers and for a ``draft_spec`` NEXTN cannot take."""
    algorithm = config.speculative_algorithm
    if algorithm not in DRAFT_MODEL_ALGORITHMS:
        if draft_spec is not None:
            raise ConfigError(
                "draft_spec",
                draft_spec.name,
                f"speculative_algorithm={algorithm!r} has no draft model; set EAGLE, EAGLE3 or STANDALONE, or drop it",
            )
        return None
    attention = LayerKind.MLA if spec.is_mla else LayerKind.FULL
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


def check_draft_attention(draft: ModelSpec, kind: ModelKind) -> None:
    """The draft pool is of the target's kind: every draft layer must cache that attention."""
    want = LayerKind.MLA if kind.is_mla else LayerKind.FULL
    other = sorted({k.value for k in draft.layer_kinds if k is not want})
    if other or draft.recurrent is not None or draft.is_dsa:
        pool = "mla" if kind.is_mla else "mha"
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
    attention, ids = draft.attention, draft.layer_ids
    kind = "mla" if isinstance(attention, MLALayout) else "mha"
    if isinstance(attention, MLALayout):
        device = dataclasses.replace(
            attention.pool_plans(num_pages=num_pages, layer_ids=ids, built=True)[0], name=DRAFT_POOL_NAME
        )
    else:
        device = attention.pool_plan(DRAFT_POOL_NAME, kind, num_pages=num_pages, layer_ids=ids)
    pools = [device]
    if host_pages is not None:
        if isinstance(attention, MLALayout):
            host = attention.pool_plans(num_pages=host_pages - 1, layer_ids=ids, built=False)[0]
        else:
            host = attention.pool_plan(DRAFT_HOST_POOL_NAME, "host_tier", num_pages=host_pages - 1, layer_ids=ids)
        pools.append(
            dataclasses.replace(
                host, name=DRAFT_HOST_POOL_NAME, kind="host_tier", memory="host", built=is_built("host_tier")
            )
        )
    return tuple(pools)


def decide_draft(
    spec: ModelSpec, config: CacheConfig, kind: ModelKind, draft_spec: ModelSpec | None
) -> tuple[DraftModel | None, tuple[str, ...]]:
    """The draft model and its layout, or None (with a warning saying why when a draft model was
    asked for and no pool is planned). Pure; ``ConfigError`` for a draft the target's pool kind
    cannot hold."""
    from kvjax.plan.target import decide_target

    draft = draft_model_spec(spec, config, draft_spec)
    algorithm = config.speculative_algorithm
    if draft is None:
        if algorithm == "STANDALONE":
            return None, ("speculative_algorithm='STANDALONE' without a draft_spec: no draft KV pool is planned",)
        return None, ()
    if kind.kv_pool_kind not in DRAFT_POOL_KINDS or kind.is_dsa:
        return None, (
            f"draft KV pools for a {'DSA' if kind.is_dsa else repr(kind.kv_pool_kind)} target are not planned "
            f"(kvjax plans them for {', '.join(DRAFT_POOL_KINDS)} targets without DSA indexer keys); "
            "build_kv_cache refuses this configuration",
        )
    check_draft_attention(draft, kind)
    draft_kind = ModelKind("mla" if kind.is_mla else "mha", is_mla=kind.is_mla)
    target: Target = decide_target(draft, config, draft_kind)
    return (
        DraftModel(
            algorithm=str(algorithm),
            spec_name=draft.name,
            attention=target.attention,
            layer_ids=draft_layer_ids(spec, config, draft),
            on_this_stage=config.pp_rank == config.pp_size - 1,
        ),
        (),
    )
