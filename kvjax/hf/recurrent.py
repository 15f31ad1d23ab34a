"""Families with a per-request recurrent state: Qwen3-Next, Falcon-H1, Nemotron-H, MiniMax.

  * ``qwen3_next``: ``full_attention`` layers FULL, ``linear_attention`` layers RECURRENT (gated
    delta net) with SGLang's Mamba2-shaped state (value heads as heads, key heads as groups).
  * ``falcon_h1``: every layer runs attention and a Mamba2 mixer side by side:
    FULL_AND_RECURRENT. ``mamba_d_ssm`` (else ``mamba_expand * hidden_size``) is the mixer's width,
    ``mamba_d_head`` ``"auto"`` is that width over ``mamba_n_heads``.
  * ``nemotron_h``: ``hybrid_override_pattern`` (``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E``
    MoE) or ``layers_block_type`` (``mamba``, ``attention``, ``mlp``, ``moe``): RECURRENT, FULL, and
    NONE for the MLP/MoE layers, which cache nothing.
  * ``minimax`` / ``minimax_m1`` / ``minimax_text_01``: ``attn_type_list`` (``0`` lightning, ``1``
    softmax) or ``layer_types`` (``linear_attention`` / ``full_attention``). Lightning (linear)
    attention layers are RECURRENT with one ``[head_dim, head_dim]`` matrix per attention head and no
    convolution (``recurrent.mixer == "lightning"``); softmax layers are FULL.

Recurrent states keep the conv window in bfloat16 and the SSM / key-value matrix in float32, SGLang's
``mamba_ssm_dtype`` default, unless the config names ``mamba_ssm_dtype`` (or Nemotron-H's
``mamba_ssm_cache_dtype``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvjax.errors import ConfigError
from kvjax.hf import keys
from kvjax.hf.keys import Fields
from kvjax.layer_kinds import LayerKind, RecurrentStateSpec, lightning_state, mamba2_state

RECURRENT_CONV_DTYPE = "bfloat16"
_CONV_DTYPES = ("float32", "bfloat16", "float16")
RECURRENT_SSM_DTYPE = "float32"
_SSM_DTYPES = ("float32", "bfloat16", "float16")


def _ssm_dtype(config: Mapping[str, Any], *key_names: str) -> str:
    for key in key_names:
        raw = config.get(key)
        if raw is not None:
            name = str(raw).removeprefix("torch.")
            if name not in _SSM_DTYPES:
                raise ConfigError(key, raw, f"use one of {list(_SSM_DTYPES)}")
            return name
    return RECURRENT_SSM_DTYPE


def gdn_state_spec(
    *,
    num_k_heads: int,
    num_v_heads: int,
    k_head_dim: int,
    v_head_dim: int,
    conv_kernel: int,
    conv_dtype: str = RECURRENT_CONV_DTYPE,
    ssm_dtype: str = RECURRENT_SSM_DTYPE,
) -> RecurrentStateSpec:
    """Per-request state of one gated-delta-net layer, unsharded (tensor-parallel size 1).

    The conv window holds the last ``conv_kernel - 1`` inputs of the q, k and v projections,
    ``[2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim, conv_kernel - 1]``. The recurrent
    matrix is ``[num_v_heads, v_head_dim, k_head_dim]``: SGLang's Mamba2 shape
    ``[heads, head_dim, state_size]`` with the value heads as heads and the key dim as state.
    """
    return mamba2_state(
        intermediate_size=num_v_heads * v_head_dim,
        n_groups=num_k_heads,
        num_heads=num_v_heads,
        head_dim=v_head_dim,
        state_size=k_head_dim,
        conv_kernel=conv_kernel,
        mixer="gated_delta_net",
        conv_dtype=conv_dtype,
        ssm_dtype=ssm_dtype,
    )


def parse_qwen3_next(config: Mapping[str, Any], family: str) -> Fields:
    fields = keys.attention_fields(config, family, head_dim_default=256)
    n = fields["num_hidden_layers"]
    allowed = {"full_attention": LayerKind.FULL, "linear_attention": LayerKind.RECURRENT}
    kinds = keys.kinds_from_layer_types(config, n, family, allowed)
    if kinds is None:
        interval = keys.integer(config, "full_attention_interval", family, 4)
        kinds = tuple(LayerKind.FULL if (i + 1) % interval == 0 else LayerKind.RECURRENT for i in range(n))
    fields["layer_kinds"] = kinds
    if LayerKind.RECURRENT in kinds:
        state_keys = (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
        keys.require(config, state_keys, family)
        fields["recurrent"] = gdn_state_spec(
            num_k_heads=keys.integer(config, "linear_num_key_heads", family),
            num_v_heads=keys.integer(config, "linear_num_value_heads", family),
            k_head_dim=keys.integer(config, "linear_key_head_dim", family),
            v_head_dim=keys.integer(config, "linear_value_head_dim", family),
            conv_kernel=keys.integer(config, "linear_conv_kernel_dim", family, minimum=2),
            # SGLang keeps the conv window in the model's dtype (a float32 checkpoint: float32).
            conv_dtype=fields["dtype"] if fields["dtype"] in _CONV_DTYPES else RECURRENT_CONV_DTYPE,
            ssm_dtype=_ssm_dtype(config, "mamba_ssm_dtype"),
        )
    # Qwen3-Next names its MTP layer count ``mtp_num_hidden_layers`` (the ``mtp.*`` tensors)
    mtp = keys.integer(config, "mtp_num_hidden_layers", family, 0, minimum=0)
    fields["num_nextn_predict_layers"] = keys.integer(config, "num_nextn_predict_layers", family, mtp, minimum=0)
    return fields


def parse_falcon_h1(config: Mapping[str, Any], family: str) -> Fields:
    fields = keys.attention_fields(config, family)
    n = fields["num_hidden_layers"]
    if config.get("attn_layer_indices") is not None:
        raise ConfigError(
            "attn_layer_indices",
            config["attn_layer_indices"],
            "kvjax reads Falcon-H1 configs with attention in every layer; remove the key or set it to null",
        )
    keys.require(config, ("mamba_n_heads", "mamba_d_state", "mamba_d_conv"), family)
    hidden = fields["hidden_size"]
    if config.get("mamba_d_ssm") is not None:
        width = keys.integer(config, "mamba_d_ssm", family)
    else:
        expand = keys.integer(config, "mamba_expand", family)
        width = expand * hidden
    heads = keys.integer(config, "mamba_n_heads", family)
    head_dim_raw = config.get("mamba_d_head", "auto")
    if head_dim_raw in (None, "auto"):
        if width % heads:
            raise ConfigError(
                "mamba_d_head", head_dim_raw, f"mamba width {width} does not split over {heads} heads; set it"
            )
        head_dim = width // heads
    else:
        head_dim = keys.integer(config, "mamba_d_head", family)
    fields["layer_kinds"] = (LayerKind.FULL_AND_RECURRENT,) * n
    fields["recurrent"] = mamba2_state(
        intermediate_size=width,
        n_groups=keys.integer(config, "mamba_n_groups", family, 1),
        num_heads=heads,
        head_dim=head_dim,
        state_size=keys.integer(config, "mamba_d_state", family),
        conv_kernel=keys.integer(config, "mamba_d_conv", family, minimum=2),
        ssm_dtype=_ssm_dtype(config, "mamba_ssm_dtype"),
    )
    return fields


_NEMOTRON_PATTERN = {"M": LayerKind.RECURRENT, "*": LayerKind.FULL, "-": LayerKind.NONE, "E": LayerKind.NONE}
_NEMOTRON_BLOCKS = {
    "mamba": LayerKind.RECURRENT,
    "attention": LayerKind.FULL,
    "mlp": LayerKind.NONE,
    "moe": LayerKind.NONE,
    # Transformers 5 saves these names.
    "linear_attention": LayerKind.RECURRENT,
    "full_attention": LayerKind.FULL,
}


def _nemotron_kinds(config: Mapping[str, Any], family: str) -> tuple[LayerKind, ...]:
    blocks = config.get("layers_block_type")
    if blocks is not None:
        if isinstance(blocks, str) or not isinstance(blocks, (list, tuple)):
            raise ConfigError("layers_block_type", blocks, f"give a list of {sorted(_NEMOTRON_BLOCKS)}")
        unknown = sorted({str(b) for b in blocks} - set(_NEMOTRON_BLOCKS))
        if unknown:
            raise ConfigError(
                "layers_block_type", unknown, f"a {keys.where(family)} supports {sorted(_NEMOTRON_BLOCKS)}"
            )
        return tuple(_NEMOTRON_BLOCKS[str(b)] for b in blocks)
    pattern = config.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern:
        fix = f"a {keys.where(family)} needs 'hybrid_override_pattern' (or 'layers_block_type'); add it to config.json"
        raise ConfigError("hybrid_override_pattern", pattern, fix)
    unknown = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
    if unknown:
        fix = "use M (Mamba2), * (attention), - (MLP) and E (MoE), one character per layer"
        raise ConfigError("hybrid_override_pattern", "".join(unknown), fix)
    return tuple(_NEMOTRON_PATTERN[c] for c in pattern)


def parse_nemotron_h(config: Mapping[str, Any], family: str) -> Fields:
    kinds = _nemotron_kinds(config, family)
    config = {"num_hidden_layers": len(kinds), **{k: v for k, v in config.items() if v is not None}}
    head_dim = keys.first_integer(config, ("head_dim", "attention_head_dim"), family, None)
    fields = keys.attention_fields(config, family, head_dim_default=head_dim)
    if len(kinds) != fields["num_hidden_layers"]:
        fix = f"give one pattern entry per layer (num_hidden_layers={fields['num_hidden_layers']})"
        raise ConfigError("hybrid_override_pattern", f"{len(kinds)} entries", fix)
    fields["layer_kinds"] = kinds
    if LayerKind.RECURRENT in kinds:
        keys.require(config, ("mamba_num_heads", "mamba_head_dim", "ssm_state_size"), family)
        heads = keys.integer(config, "mamba_num_heads", family)
        head_dim = keys.integer(config, "mamba_head_dim", family)
        fields["recurrent"] = mamba2_state(
            intermediate_size=heads * head_dim,
            n_groups=keys.first_integer(config, ("n_groups", "mamba_n_groups"), family),
            num_heads=heads,
            head_dim=head_dim,
            state_size=keys.integer(config, "ssm_state_size", family),
            conv_kernel=keys.first_integer(config, ("conv_kernel", "mamba_d_conv"), family),
            conv_dtype=fields["dtype"] if fields["dtype"] in _CONV_DTYPES else RECURRENT_CONV_DTYPE,
            ssm_dtype=_ssm_dtype(config, "mamba_ssm_dtype", "mamba_ssm_cache_dtype"),
        )
    return fields


def _minimax_kinds(config: Mapping[str, Any], n: int, family: str) -> tuple[LayerKind, ...]:
    allowed = {"full_attention": LayerKind.FULL, "linear_attention": LayerKind.RECURRENT}
    kinds = keys.kinds_from_layer_types(config, n, family, allowed)
    if kinds is not None:
        return kinds
    types = config.get("attn_type_list")
    if not isinstance(types, (list, tuple)) or len(types) != n or any(t not in (0, 1) for t in types):
        fix = f"give 'attn_type_list' (0 lightning, 1 softmax) or 'layer_types' with one entry per layer ({n})"
        raise ConfigError("attn_type_list", types if types is None else f"{len(types)} entries", fix)
    return tuple(LayerKind.FULL if t == 1 else LayerKind.RECURRENT for t in types)


def parse_minimax(config: Mapping[str, Any], family: str) -> Fields:
    fields = keys.attention_fields(config, family)
    kinds = _minimax_kinds(config, fields["num_hidden_layers"], family)
    fields["layer_kinds"] = kinds
    if LayerKind.RECURRENT in kinds:
        fields["recurrent"] = lightning_state(
            num_heads=fields["num_attention_heads"],
            head_dim=fields["head_dim"],
            dtype=_ssm_dtype(config, "mamba_ssm_dtype"),
        )
    return fields
