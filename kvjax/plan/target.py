"""Step 2 of the planner: the layout on the target platform, and the parallel and page settings
that layout cannot take (pure).

Refused as SGLang refuses them (``ConfigError`` naming the flag, the value and the fix):

* attention heads that do not split over the attention-TP ranks (SGLang's ``divide``);
* KV heads versus TP: with ``tp <= heads`` the heads must split evenly; with ``tp > heads`` each
  rank keeps one head and ``tp`` must be a multiple of the heads, each head replicated
  ``tp / heads`` times (SGLang's ``QKVParallelLinear``);
* recurrent state that does not split over the TP ranks (``RecurrentStateSpec.per_rank``).

Refused for TPU only: a ``page_size`` that is not a multiple of the dtype's packing (tokens per
32-bit word: bf16 2, fp8 4), which tpu-inference's ragged paged attention (RPA v3) requires.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.plan.records import ModelKind, Target
from kvjax.pools import storage
from kvjax.pools.alignment import tpu_packing
from kvjax.pools.mha_layout import MHALayout
from kvjax.pools.mla_layout import MLALayout
from kvjax.pools.recurrent_layout import RecurrentLayout
from kvjax.spec import ModelSpec

DEFAULT_PLATFORM = "tpu"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_heads_per_rank(num_kv_heads: int, attn_tp: int) -> tuple[int, int]:
    """``(heads per rank, replicas per head)`` as SGLang splits KV heads over ``attn_tp`` ranks.

    Raises ``ConfigError`` on ``tp_size`` for a split SGLang refuses.
    """
    if attn_tp <= num_kv_heads:
        if num_kv_heads % attn_tp:
            raise ConfigError(
                "tp_size",
                attn_tp,
                f"the model's {num_kv_heads} KV heads cannot be split evenly over {attn_tp} ranks (--tp {attn_tp}); "
                f"use --tp {', '.join(map(str, _divisors(num_kv_heads)))} or a multiple of {num_kv_heads}",
            )
        return num_kv_heads // attn_tp, 1
    if attn_tp % num_kv_heads:
        raise ConfigError(
            "tp_size",
            attn_tp,
            f"--tp {attn_tp} exceeds the model's {num_kv_heads} KV heads, so each head is replicated and the TP "
            f"size must be a multiple of {num_kv_heads}; use --tp {attn_tp - attn_tp % num_kv_heads} or "
            f"{attn_tp + num_kv_heads - attn_tp % num_kv_heads}",
        )
    return 1, attn_tp // num_kv_heads


def check_attention_heads(spec: ModelSpec, attn_tp: int) -> None:
    """SGLang splits the query heads evenly over the attention-TP ranks."""
    heads = spec.num_attention_heads
    if heads > 0 and heads % attn_tp:
        raise ConfigError(
            "tp_size",
            attn_tp,
            f"the model's {heads} attention heads cannot be split evenly over {attn_tp} ranks (--tp {attn_tp}); "
            f"use --tp {', '.join(str(d) for d in _divisors(heads) if d <= 64)}",
        )


def check_tpu_page_size(page_size: int, kv_dtype: str) -> None:
    """tpu-inference's RPA v3 packs ``32 / bits`` tokens of the KV dtype per word: the page must hold whole words."""
    packing = tpu_packing(storage.itemsize(kv_dtype))
    if page_size % packing:
        raise ConfigError(
            "page_size",
            page_size,
            f"on TPU the ragged paged attention kernel (tpu-inference RPA v3) packs {packing} {kv_dtype} tokens "
            f"into each 32-bit word, so the page size must be a multiple of {packing}; use --page-size 16 "
            f"(or another multiple of {packing})",
        )


def decide_target(spec: ModelSpec, config: CacheConfig, kind: ModelKind) -> Target:
    """The dtype, heads per rank and padded layout of each pool, for ``config.platform`` (TPU by default)."""
    platform = config.platform or DEFAULT_PLATFORM
    kv_dtype = spec.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    attn_tp = config.attn_tp_size
    check_attention_heads(spec, attn_tp)
    if platform == "tpu":
        check_tpu_page_size(config.page_size, kv_dtype)
    attention: MHALayout | MLALayout
    if kind.is_mla:
        heads, replicas = 1, attn_tp  # one latent "head", replicated on every rank
        assert spec.kv_lora_rank is not None and spec.qk_rope_head_dim is not None  # ModelSpec checks it
        mla = MLALayout.for_platform(
            kv_lora_rank=spec.kv_lora_rank,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            page_size=config.alloc_page_size,
            dtype=kv_dtype,
            platform=platform,
            index_head_dim=spec.index_head_dim if spec.is_dsa else None,
        )
        attention, padded = mla, mla.row_padded
        per_layer = mla.bytes_per_token_per_layer + mla.indexer_bytes_per_token_per_layer
    else:
        heads, replicas = kv_heads_per_rank(spec.num_kv_heads, attn_tp)
        mha = MHALayout.for_platform(
            num_kv_heads=heads,
            head_dim=spec.head_dim,
            v_head_dim=spec.v_head_dim,
            page_size=config.alloc_page_size,
            dtype=kv_dtype,
            platform=platform,
        )
        attention, padded, per_layer = mha, mha.head_dim_padded, mha.bytes_per_token_per_layer
    recurrent = None
    if spec.recurrent is not None:
        state = spec.recurrent
        if config.mamba_ssm_dtype is not None:
            state = dataclasses.replace(state, ssm_dtype=config.mamba_ssm_dtype)
        recurrent = RecurrentLayout.per_rank(state, config.tp_size)  # SGLang shards state over full TP
    padding = attention.padding()
    if replicas > 1 and not kind.is_mla:
        padding += (f"{spec.num_kv_heads} KV heads over {attn_tp} ranks: each head replicated {replicas}x",)
    return Target(
        platform=platform,
        kv_cache_dtype=kv_dtype,
        storage_dtype=storage.storage_dtype_name(kv_dtype, platform),
        num_kv_heads_per_rank=heads,
        kv_head_replicas=replicas,
        head_dim_padded=padded,
        attention=attention,
        recurrent=recurrent,
        attention_bytes_per_token_per_layer=per_layer,
        padding=padding,
    )
