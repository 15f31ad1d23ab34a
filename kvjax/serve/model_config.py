"""The serving model's hyperparameters, read from a Hugging Face ``config.json``.

The planner's `ModelSpec` holds what the *cache* needs (layers, KV heads, head dims). Running the
model needs a few more facts: the RMSNorm epsilon, the RoPE variant and its parameters, whether
the LM head is tied to the embedding, the projection biases of the family, and q/k norms. This
module reads them, from configs saved by any Transformers version:

* RoPE: ``rope_theta`` + ``rope_scaling`` (older) or ``rope_parameters`` (Transformers 5, which
  also holds ``rope_theta``); ``rope_type`` or the older ``type`` key.
* dtype: ``dtype`` (Transformers 5) or ``torch_dtype`` (older).

Supported RoPE types: ``default``, ``linear`` and ``llama3`` (Llama 3.1+), and ``yarn`` for the
families that apply its attention scaling (``Family.yarn_rope``: gpt-oss). Others raise
`ConfigError` naming the type. Families are the entries of ``kvjax.serve.families.FAMILIES``; a
family's own hyperparameters (beyond the fields below) are read by its ``read_config`` into
``ModelConfig.family_config``.

A `ModelConfig` is frozen and hashable: compiled steps and random weights are cached per config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from kvjax.errors import ConfigError
from kvjax.serve.families import SERVABLE_FAMILIES, family
from kvjax.spec import LayerKind, ModelSpec

__all__ = ["DTYPES", "ROPE_TYPES", "SERVABLE_FAMILIES", "ModelConfig", "RopeConfig", "model_config_from_spec"]

ROPE_TYPES = ("default", "linear", "llama3")
YARN = "yarn"
DTYPES = ("float32", "bfloat16", "float16")

FamilySettings = TypeVar("FamilySettings")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding of the full head dim.

    ``rope_type``: ``"default"`` (inverse frequencies ``theta ** (-2i / head_dim)``), ``"linear"``
    (all divided by ``factor``) or ``"llama3"`` (long wavelengths divided by ``factor``, short ones
    kept, a smooth blend between; ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings`` as in Llama 3.1's config) or ``"yarn"`` (YaRN: a linear ramp
    between the interpolated ``base / factor`` and the original frequencies over the dims whose
    rotation count in ``original_max_position_embeddings`` lies between ``beta_fast`` and
    ``beta_slow``, bounds floored/ceiled when ``truncate``; cos and sin are multiplied by
    ``attention_scaling()``), all as Transformers 5.24's ``modeling_rope_utils`` computes them.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def attention_scaling(self) -> float:
        """The factor on cos and sin (YaRN's; 1.0 for the other types)."""
        if self.rope_type != YARN:
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return get_mscale(self.factor)

    def _yarn(self, head_dim: int) -> np.ndarray:
        dim, base, original = head_dim, self.theta, self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # Transformers' guard against a zero-width ramp
        pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
        interpolation = (np.float32(1.0) / (np.float32(self.factor) * pos_freqs)).astype(np.float32)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        keep = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
        return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        """The ``head_dim // 2`` inverse frequencies (radians per position), float32.

        Computed in float32 the way Transformers computes them, so positions rotate by the same
        angles as in the reference implementation.
        """
        exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
        base = (np.float32(1.0) / (np.float32(self.theta) ** exponent)).astype(np.float32)
        if self.rope_type == "default":
            return base
        if self.rope_type == YARN:
            return self._yarn(head_dim)
        factor = np.float32(self.factor)
        if self.rope_type == "linear":
            return (base / factor).astype(np.float32)
        # llama3: the rule of Llama 3.1's reference implementation.
        old = np.float32(self.original_max_position_embeddings)
        low, high = np.float32(self.low_freq_factor), np.float32(self.high_freq_factor)
        wavelen = np.float32(2 * math.pi) / base
        scaled = np.where(wavelen > old / low, base / factor, base).astype(np.float32)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, blended, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the serving model needs to run one checkpoint (dims in elements).

    ``dtype`` is the dtype of the weights and activations (the checkpoint's, or an override);
    logits are always float32. ``qkv_bias``/``o_bias``: biases of the attention projections;
    ``mlp_bias``: of the MLP projections. The family (``kvjax.serve.families.FAMILIES``) decides
    the rest of the architecture (Qwen3's q/k norms); ``family_config`` holds what its
    ``read_config`` read (None for families that need nothing more), frozen and hashable.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "float32"
    family_config: Any = None

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def family_settings(self, kind: type[FamilySettings]) -> FamilySettings:
        """``family_config``, which must be the ``kind`` its family's ``read_config`` returns; a
        `ConfigError` naming the fix otherwise (a config built by hand without it)."""
        if not isinstance(self.family_config, kind):
            raise ConfigError(
                "family_config",
                self.family_config,
                f"a {self.family} ModelConfig needs its {kind.__name__} (model_config_from_spec reads it)",
            )
        return self.family_config


def _number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, value, f"'{key}' in config.json must be a number")
    return float(value)


def read_rope(config: Mapping[str, Any], *, partial_rotary: bool = False, yarn: bool = False) -> RopeConfig:
    """The RoPE settings from either config layout (see the module docstring). A
    ``partial_rotary_factor`` is refused unless the family rotates part of the head itself
    (``partial_rotary``: it reads the factor); ``yarn`` is refused unless the family applies its
    attention scaling (``yarn``)."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    source = "rope_parameters"
    if not isinstance(params, Mapping):
        params = scaling if isinstance(scaling, Mapping) else {}
        source = "rope_scaling"
    theta = config.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type == YARN and not yarn:
        raise ConfigError(
            f"{source}.rope_type",
            rope_type,
            "kvjax serves YaRN RoPE only in families that apply its attention scaling (gpt_oss)",
        )
    if rope_type not in ROPE_TYPES and rope_type != YARN:
        raise ConfigError(
            f"{source}.rope_type",
            rope_type,
            f"kvjax serves RoPE types {list(ROPE_TYPES)}; this checkpoint's RoPE variant is not built yet",
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0 and not partial_rotary:
        raise ConfigError(
            f"{source}.partial_rotary_factor", params["partial_rotary_factor"], "kvjax rotates the full head dim only"
        )
    theta_value = _number({"rope_theta": theta}, "rope_theta", 10000.0)
    if rope_type == "default":
        return RopeConfig(theta=theta_value)
    factor = _number(params, "factor", 1.0)
    if rope_type == "linear":
        return RopeConfig(theta=theta_value, rope_type="linear", factor=factor)
    original = params.get("original_max_position_embeddings") or config.get("max_position_embeddings") or 8192
    if rope_type == YARN:
        optional: dict[str, float | None] = {
            key: None if params.get(key) is None else _number(params, key, 0.0)
            for key in ("attention_factor", "mscale", "mscale_all_dim")
        }
        return RopeConfig(
            theta=theta_value,
            rope_type=YARN,
            factor=factor
            if params.get("factor") is not None
            else _number(config, "max_position_embeddings", original) / float(original),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=optional["attention_factor"],
            mscale=optional["mscale"],
            mscale_all_dim=optional["mscale_all_dim"],
        )
    return RopeConfig(
        theta=theta_value,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=_number(params, "low_freq_factor", 1.0),
        high_freq_factor=_number(params, "high_freq_factor", 4.0),
        original_max_position_embeddings=int(original),
    )


#: The ``ModelConfig`` dims the spec holds as they are.
_DIMS_FROM_SPEC = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
)


def model_config_from_spec(spec: ModelSpec, *, dtype: str | None = None) -> ModelConfig:
    """The serving hyperparameters of ``spec`` (its raw ``config.json`` is ``spec.extra``).

    Raises `ConfigError` for a family kvjax cannot serve, layer kinds its model does not run
    (e.g. sliding-window layers in a full-attention family), an activation other than SiLU, or an
    unsupported RoPE variant.
    """
    raw: Mapping[str, Any] = spec.extra
    entry = family(spec.model_type)
    if entry.text_config is not None:  # a vision-language model: its language model's config
        text = raw.get(entry.text_config)
        raw = text if isinstance(text, Mapping) else {}
    unsupported = sorted({kind.value for kind in spec.layer_kinds} - {kind.value for kind in entry.layer_kinds})
    if unsupported:
        if unsupported == [LayerKind.SLIDING.value]:
            raise ConfigError(
                "sliding_window",
                spec.sliding_window,
                f"kvjax serves {entry.name} with full-attention layers only; set sliding_window to null "
                "(or use_sliding_window to false) if the window is not needed",
            )
        raise ConfigError(
            "layer_types",
            unsupported,
            f"kvjax's {entry.name} model runs {sorted(k.value for k in entry.layer_kinds)} layers only",
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError("hidden_act", act, "kvjax's serving MLP is SwiGLU; only 'silu' is supported")
    dtype = dtype or spec.dtype
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"serve in one of {list(DTYPES)}")
    if spec.intermediate_size <= 0:
        raise ConfigError("intermediate_size", spec.intermediate_size, "config.json needs a positive intermediate_size")
    bias = bool(raw.get("attention_bias", False))
    family_config = entry.load("read_config")(spec, raw) if entry.read_config else None
    return ModelConfig(
        family=entry.name,
        **{dim: getattr(spec, dim) for dim in _DIMS_FROM_SPEC},
        rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
        rope=read_rope(raw, partial_rotary=entry.partial_rotary, yarn=entry.yarn_rope),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (no config key); the others follow attention_bias.
        qkv_bias=True if entry.qkv_bias else bias,
        o_bias=False if entry.qkv_bias else bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if entry.mlp_bias else False,
        dtype=dtype,
        family_config=family_config,
    )
