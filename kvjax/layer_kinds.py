"""What one decoder layer caches: `LayerKind`, the per-request recurrent state, element sizes.

These are the vocabulary `ModelSpec` and the Hugging Face readers (``kvjax.hf``) share. The module
imports nothing of kvjax but its errors, so both can depend on it without depending on each other.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from kvjax.errors import ConfigError


class LayerKind(enum.StrEnum):
    """What one decoder layer keeps between steps.

    A layer either caches per-token attention rows (FULL, SLIDING, MLA), a fixed-size per-request
    state (RECURRENT), both side by side (FULL_AND_RECURRENT: Falcon-H1 runs attention and a Mamba2
    mixer in parallel in every layer), or nothing (NONE: Nemotron-H's MLP and MoE layers).
    """

    FULL = "full_attention"  # K and V for every token
    SLIDING = "sliding_attention"  # K and V for the last ``sliding_window`` tokens
    MLA = "mla"  # one latent row per token: kv_lora_rank + qk_rope_head_dim
    RECURRENT = "recurrent"  # a fixed-size state per request (Mamba2, gated delta net, lightning attention)
    FULL_AND_RECURRENT = "full_attention_and_recurrent"  # K and V for every token, plus a recurrent state
    NONE = "none"  # no cache at all (MLP- or MoE-only layers)

    @property
    def attention(self) -> LayerKind | None:
        """The per-token attention cache of this kind (FULL, SLIDING or MLA), or None."""
        if self is LayerKind.FULL_AND_RECURRENT:
            return LayerKind.FULL
        if self in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.MLA):
            return self
        return None

    @property
    def has_recurrent_state(self) -> bool:
        """True when a layer of this kind keeps a per-request recurrent state."""
        return self in (LayerKind.RECURRENT, LayerKind.FULL_AND_RECURRENT)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}

# The recurrent mixers kvjax knows, by the name `RecurrentStateSpec.mixer` records.
RECURRENT_MIXERS = ("mamba2", "gated_delta_net", "lightning")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as kvjax names them (``"bfloat16"``, ``"fp8_e4m3"``, ...)."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError("dtype", dtype, f"use one of {sorted(_DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Per-request state of one recurrent layer (Mamba2, gated delta net, lightning attention).

    Shapes are unsharded (tensor-parallel size 1) and exclude the leading ``[num_layers, num_slots]``
    axes of the state pool. ``conv_state_shapes`` holds one ``[channels, conv_kernel - 1]`` shape per
    conv tensor (empty for lightning attention, which has no convolution); ``ssm_state_shape`` is
    ``[heads, head_dim, state_size]``.

    The layout fields say how SGLang shards the state over tensor parallelism (its
    ``Mamba2StateShape.create``): ``num_heads`` (the SSM's first axis) split evenly; the conv channels
    are ``intermediate + 2 * n_groups * state_size`` with the B/C groups replicated up to the TP size
    when there is one group. A state built without them (``num_heads is None``) can only be split
    along its first axes, evenly; see `per_rank`.
    """

    conv_state_shapes: tuple[tuple[int, ...], ...]
    conv_dtype: str
    ssm_state_shape: tuple[int, ...]
    ssm_dtype: str
    mixer: str = "mamba2"
    num_heads: int | None = None
    n_groups: int = 0
    state_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "conv_state_shapes", tuple(tuple(s) for s in self.conv_state_shapes))
        object.__setattr__(self, "ssm_state_shape", tuple(self.ssm_state_shape))
        if self.mixer not in RECURRENT_MIXERS:
            raise ConfigError("mixer", self.mixer, f"use one of {list(RECURRENT_MIXERS)}")
        dtype_bytes(self.conv_dtype)
        dtype_bytes(self.ssm_dtype)

    def bytes_per_slot(self) -> int:
        """Bytes of one request's state in one layer (all conv tensors plus the SSM tensor)."""
        conv = sum(math.prod(s) for s in self.conv_state_shapes) * dtype_bytes(self.conv_dtype)
        return conv + math.prod(self.ssm_state_shape) * dtype_bytes(self.ssm_dtype)

    def with_ssm_dtype(self, ssm_dtype: str) -> RecurrentStateSpec:
        """The same state with the SSM tensor stored as ``ssm_dtype`` (SGLang's ``mamba_ssm_dtype``)."""
        return replace(self, ssm_dtype=ssm_dtype)

    def per_rank(self, tp_size: int) -> RecurrentStateSpec:
        """The state one tensor-parallel rank holds, as SGLang shards it.

        Heads split evenly over ``tp_size``; the conv channels too, after replicating a single B/C
        group to every rank. Raises `ConfigError` on ``tp_size`` when the heads, groups or channels do
        not split evenly (SGLang's ``divide`` asserts the same).
        """
        if tp_size < 1:
            raise ConfigError("tp_size", tp_size, "must be >= 1")
        if tp_size == 1:
            return self
        if self.num_heads is None:
            return replace(
                self,
                conv_state_shapes=tuple(
                    (_split(s[0], tp_size, "conv channels"), *s[1:]) for s in self.conv_state_shapes
                ),
                ssm_state_shape=(_split(self.ssm_state_shape[0], tp_size, "state heads"), *self.ssm_state_shape[1:]),
            )
        heads = _split(self.num_heads, tp_size, f"{self.mixer} heads")
        conv_shapes = self.conv_state_shapes
        if conv_shapes:
            channels, *rest = conv_shapes[0]
            groups = self.n_groups
            if groups % tp_size:
                if groups != 1:
                    raise ConfigError(
                        "tp_size",
                        tp_size,
                        f"the {self.mixer} state has {groups} B/C groups; use a tp size that divides them "
                        "(a single group is replicated, more are not)",
                    )
                channels += (tp_size - groups) * 2 * self.state_size
            conv_shapes = ((_split(channels, tp_size, "conv channels"), *rest), *conv_shapes[1:])
        return replace(
            self,
            conv_state_shapes=conv_shapes,
            ssm_state_shape=(heads, *self.ssm_state_shape[1:]),
            num_heads=heads,
            n_groups=max(1, self.n_groups // tp_size) if self.n_groups else 0,
        )


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ConfigError(
            "tp_size", parts, f"the recurrent state's {n} {what} do not split evenly; use a tp size that divides {n}"
        )
    return n // parts


def mamba2_state(
    *,
    intermediate_size: int,
    n_groups: int,
    num_heads: int,
    head_dim: int,
    state_size: int,
    conv_kernel: int,
    mixer: str = "mamba2",
    conv_dtype: str = "bfloat16",
    ssm_dtype: str = "float32",
) -> RecurrentStateSpec:
    """SGLang's Mamba2-shaped state, unsharded: conv ``[intermediate + 2 * n_groups * state_size,
    conv_kernel - 1]`` and SSM ``[num_heads, head_dim, state_size]``. Gated delta nets use it with the
    value heads as heads, the value dim as head dim and the key heads and dim as groups and state."""
    conv_dim = intermediate_size + 2 * n_groups * state_size
    return RecurrentStateSpec(
        conv_state_shapes=((conv_dim, conv_kernel - 1),),
        conv_dtype=conv_dtype,
        ssm_state_shape=(num_heads, head_dim, state_size),
        ssm_dtype=ssm_dtype,
        mixer=mixer,
        num_heads=num_heads,
        n_groups=n_groups,
        state_size=state_size,
    )


def lightning_state(*, num_heads: int, head_dim: int, dtype: str = "float32") -> RecurrentStateSpec:
    """Lightning (linear) attention's per-request state: one ``[head_dim, head_dim]`` key-value
    matrix per head, no convolution (MiniMax-Text-01 / M1)."""
    return RecurrentStateSpec(
        conv_state_shapes=(),
        conv_dtype="bfloat16",
        ssm_state_shape=(num_heads, head_dim, head_dim),
        ssm_dtype=dtype,
        mixer="lightning",
        num_heads=num_heads,
    )
