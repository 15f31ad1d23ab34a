"""Step 2 of the planner: the layout on the target platform, and the parallel and page settings
that layout cannot take (pure).

Refused as SGLang refuses them (``ConfigError`` naming the flag, the value and the fix):

* attention heads that do not split over the attention-TP ranks (SGLang's ``divide``);
* KV heads versus TP: with ``tp <= heads`` the heads must split evenly; with ``tp > heads`` each
  rank keeps one head and ``tp`` must be a multiple of the heads, each head replicated
  ``tp / heads`` times (SGLang's ``QKVParallelLinear``);
* recurrent state that does not split over the attention-TP ranks (``RecurrentStateSpec.per_rank``;
  under decode context parallelism over the whole TP group, ``state_tp_size``);
* more pipeline stages than layers (a stage without a layer).

A refused TP size is answered with every size that passes all three TP checks, never one that
would be refused in turn.

Refused for TPU only: a ``page_size`` that is not a multiple of the dtype's packing (tokens per
32-bit word: bf16 2, fp8 4), which tpu-inference's ragged paged attention (RPA v3) requires.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.layout import storage
from kvjax.layout.alignment import tpu_packing
from kvjax.layout.mha import kv_heads_refusal
from kvjax.layout.recurrent import RecurrentLayout
from kvjax.plan.kinds.planning import layout_kind
from kvjax.plan.records import ModelKind, Target
from kvjax.spec import ModelSpec

DEFAULT_PLATFORM = "tpu"


# TP sizes a refusal suggests are searched up to this (or the head count, when larger).
MAX_SUGGESTED_TP = 64


def state_tp_size(config: CacheConfig) -> int:
    """The ranks recurrent state is split over by heads: the attention-TP group (``tp / dp`` under
    DP attention), which decode context parallelism does not divide for it: the state is per
    request, not per token, so it is not striped over the ``dcp`` ranks but split by heads over
    all of the group's chips, as the recurrent layers' weights are (``kvjax.plan.dcp``)."""
    return config.attn_tp_size * config.dcp_size


def _tp_refusal(spec: ModelSpec, splits_kv_heads: bool, attn_tp: int, tp: int, dcp: int = 1) -> str | None:
    """Why SGLang refuses ``attn_tp`` attention ranks (``tp`` in all; ``dcp``: the decode-context-
    parallel ranks, which the recurrent state's heads split over too) for this model, or None."""
    heads = spec.num_attention_heads
    if heads > 0 and heads % attn_tp:
        return f"the model's {heads} attention heads cannot be split evenly over {attn_tp} ranks"
    if splits_kv_heads and spec.num_kv_heads > 0:
        refusal = kv_heads_refusal(spec.num_kv_heads, attn_tp)
        if refusal is not None:
            return refusal
    if spec.recurrent is not None:
        try:
            RecurrentLayout.per_rank(spec.recurrent, attn_tp * dcp)
        except ConfigError as e:
            return e.render_fix()
    return None


def allowed_tp_sizes(spec: ModelSpec, splits_kv_heads: bool) -> list[int]:
    """Every TP size (without DP attention) SGLang would shard this model over, up to
    ``max(MAX_SUGGESTED_TP, attention heads)``."""
    upto = max(MAX_SUGGESTED_TP, spec.num_attention_heads)
    return [tp for tp in range(1, upto + 1) if _tp_refusal(spec, splits_kv_heads, tp, tp) is None]


def check_tensor_parallel(spec: ModelSpec, config: CacheConfig, splits_kv_heads: bool) -> None:
    """Refuse a TP size SGLang cannot shard this model over, suggesting only sizes that plan
    (``splits_kv_heads``: the layout splits the KV heads over the ranks; a latent row does not)."""
    attn_tp = config.attn_tp_size
    refusal = _tp_refusal(spec, splits_kv_heads, attn_tp, config.tp_size, config.dcp_size)
    if refusal is None:
        return
    fix = "no TP size splits this model"
    if not config.enable_dp_attention:
        allowed = allowed_tp_sizes(spec, splits_kv_heads)
        if allowed:
            listed = ", ".join(map(str, allowed[:-1])) + (" or " if len(allowed) > 1 else "") + str(allowed[-1])
            fix = f"use {{tp_size}} {listed}"
    raise ConfigError("tp_size", config.tp_size, f"{refusal}; {fix}")


def check_pipeline_stages(spec: ModelSpec, pp_size: int) -> None:
    """Every pipeline stage holds at least one layer: more stages than layers is refused."""
    layers = spec.num_hidden_layers
    if pp_size > layers:
        raise ConfigError(
            "pp_size",
            pp_size,
            f"the model has {layers} layers, so at most {layers} pipeline stages (each holds at least one layer); "
            f"use {{pp_size}} {layers} or fewer",
        )


def check_tpu_page_size(page_size: int, kv_dtype: str) -> None:
    """tpu-inference's RPA v3 packs ``32 / bits`` tokens of the KV dtype per word: the page must hold whole words."""
    packing = tpu_packing(storage.itemsize(kv_dtype))
    if page_size % packing:
        raise ConfigError(
            "page_size",
            page_size,
            f"on TPU the ragged paged attention kernel (tpu-inference RPA v3) packs {packing} {kv_dtype} tokens "
            f"into each 32-bit word, so the page size must be a multiple of {packing}; use {{page_size}} 16 "
            f"(or another multiple of {packing})",
        )


def decide_target(spec: ModelSpec, config: CacheConfig, kind: ModelKind) -> Target:
    """The dtype, heads per rank and padded layout of each pool, for ``config.platform`` (TPU by
    default); the attention layout is the model's layout kind's (``PlannerKind.attention_layout``)."""
    platform = config.platform or DEFAULT_PLATFORM
    kv_dtype = spec.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    laid_out_by = layout_kind(kind)
    check_tensor_parallel(spec, config, laid_out_by.splits_kv_heads)
    if platform == "tpu":
        check_tpu_page_size(config.page_size, kv_dtype)
    assert laid_out_by.attention_layout is not None  # layout_kind picks a kind with one
    choice = laid_out_by.attention_layout(spec, config, platform, kv_dtype)
    recurrent = None
    if spec.recurrent is not None:
        state = spec.recurrent
        if config.mamba_ssm_dtype is not None:
            state = dataclasses.replace(state, ssm_dtype=config.mamba_ssm_dtype)
        # SGLang's mamba cache params shard the state over the attention-TP group
        # (get_attention_tp_size: tp_size / dp_size under DP attention), like the KV heads; DCP
        # stripes tokens, not the per-request state, so its heads stay split over the whole group.
        recurrent = RecurrentLayout.per_rank(state, state_tp_size(config))
    return Target(
        platform=platform,
        kv_cache_dtype=kv_dtype,
        storage_dtype=storage.storage_dtype_name(kv_dtype, platform),
        num_kv_heads_per_rank=choice.heads_per_rank,
        kv_head_replicas=choice.replicas,
        head_dim_padded=choice.head_dim_padded,
        attention=choice.layout,
        recurrent=recurrent,
        attention_bytes_per_token_per_layer=choice.bytes_per_token_per_layer,
        padding=choice.padding,
        tp_size=config.tp_size,
        attn_tp_size=config.attn_tp_size,
        dp_size=config.dp_size if config.enable_dp_attention else 1,
    )
