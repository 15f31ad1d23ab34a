"""Hand-built model specs for planner and build tests (independent of the shipped presets)."""

from __future__ import annotations

from kvjax.spec import LayerKind, ModelSpec, RecurrentStateSpec

F, S, M, R = LayerKind.FULL, LayerKind.SLIDING, LayerKind.MLA, LayerKind.RECURRENT


def dense(
    layers: int = 4,
    kv_heads: int = 8,
    head_dim: int = 128,
    v_head_dim: int | None = None,
    context: int = 4096,
    dtype: str = "bfloat16",
    multimodal: bool = False,
) -> ModelSpec:
    return ModelSpec(
        name="dense",
        model_type="llama",
        architectures=("LlamaForCausalLM",),
        num_hidden_layers=layers,
        layer_kinds=(F,) * layers,
        num_attention_heads=4 * kv_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim if v_head_dim is None else v_head_dim,
        hidden_size=4 * kv_heads * head_dim,
        vocab_size=1000,
        context_length=context,
        dtype=dtype,
        is_multimodal=multimodal,
    )


def swa(pattern: tuple[LayerKind, ...] = (S, S, S, F), window: int = 1024) -> ModelSpec:
    return ModelSpec(
        name="swa",
        model_type="gemma3_text",
        architectures=(),
        num_hidden_layers=len(pattern),
        layer_kinds=pattern,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=128,
        v_head_dim=128,
        hidden_size=1024,
        vocab_size=1000,
        context_length=32768,
        sliding_window=window,
    )


def ssm(pattern: tuple[LayerKind, ...] = (R, R, R, F)) -> ModelSpec:
    state = RecurrentStateSpec(
        conv_state_shapes=((256, 3),), conv_dtype="bfloat16", ssm_state_shape=(4, 64, 64), ssm_dtype="float32"
    )
    return ModelSpec(
        name="ssm",
        model_type="qwen3_next",
        architectures=(),
        num_hidden_layers=len(pattern),
        layer_kinds=pattern,
        num_attention_heads=8,
        num_kv_heads=2,
        head_dim=128,
        v_head_dim=128,
        hidden_size=1024,
        vocab_size=1000,
        context_length=32768,
        recurrent=state,
    )


def mla(layers: int = 4, dsa: bool = False) -> ModelSpec:
    return ModelSpec(
        name="mla",
        model_type="deepseek_v3",
        architectures=(),
        num_hidden_layers=layers,
        layer_kinds=(M,) * layers,
        num_attention_heads=16,
        num_kv_heads=1,
        head_dim=192,
        v_head_dim=128,
        hidden_size=1024,
        vocab_size=1000,
        context_length=32768,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        is_dsa=dsa,
        index_head_dim=128 if dsa else None,
    )
