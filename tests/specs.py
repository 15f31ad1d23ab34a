"""Hand-built model specs for planner and build tests (independent of the shipped presets)."""

from __future__ import annotations

from typing import Any

from kvjax.spec import LayerKind, ModelSpec, RecurrentStateSpec

F, S, M, R = LayerKind.FULL, LayerKind.SLIDING, LayerKind.MLA, LayerKind.RECURRENT

# What the hybrid and latent specs share: 8 heads of 128 over a 1024-wide model, 32K context.
_HYBRID = {"architectures": (), "num_attention_heads": 8, "head_dim": 128, "v_head_dim": 128, "hidden_size": 1024}


def _spec(name: str, model_type: str, pattern: tuple[LayerKind, ...], **fields: Any) -> ModelSpec:
    """A spec of the layers ``pattern``, vocabulary 1000; ``fields`` set the rest."""
    return ModelSpec(
        name=name, model_type=model_type, num_hidden_layers=len(pattern), layer_kinds=pattern, vocab_size=1000, **fields
    )


def dense(
    layers: int = 4,
    kv_heads: int = 8,
    head_dim: int = 128,
    v_head_dim: int | None = None,
    context: int = 4096,
    dtype: str = "bfloat16",
    multimodal: bool = False,
) -> ModelSpec:
    heads = {"num_attention_heads": 4 * kv_heads, "num_kv_heads": kv_heads, "head_dim": head_dim}
    widths = {"v_head_dim": head_dim if v_head_dim is None else v_head_dim, "hidden_size": 4 * kv_heads * head_dim}
    serving = {"context_length": context, "dtype": dtype, "is_multimodal": multimodal}
    return _spec("dense", "llama", (F,) * layers, architectures=("LlamaForCausalLM",), **heads, **widths, **serving)


def swa(pattern: tuple[LayerKind, ...] = (S, S, S, F), window: int = 1024) -> ModelSpec:
    return _spec("swa", "gemma3_text", pattern, **_HYBRID, num_kv_heads=4, context_length=32768, sliding_window=window)


def ssm(pattern: tuple[LayerKind, ...] = (R, R, R, F)) -> ModelSpec:
    state = RecurrentStateSpec(
        conv_state_shapes=((256, 3),), conv_dtype="bfloat16", ssm_state_shape=(4, 64, 64), ssm_dtype="float32"
    )
    return _spec("ssm", "qwen3_next", pattern, **_HYBRID, num_kv_heads=2, context_length=32768, recurrent=state)


def mla(layers: int = 4, dsa: bool = False) -> ModelSpec:
    heads = {**_HYBRID, "num_attention_heads": 16, "num_kv_heads": 1, "head_dim": 192, "context_length": 32768}
    latent = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "is_dsa": dsa, "index_head_dim": 128 if dsa else None}
    return _spec("mla", "deepseek_v3", (M,) * layers, **heads, **latent)
