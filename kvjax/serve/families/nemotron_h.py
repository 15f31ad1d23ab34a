"""Nemotron-H: Mamba2 mixers, attention without rotary embeddings and ReLU² MLPs in a stack of
pre-norm residual blocks, following Hugging Face's ``NemotronHForCausalLM`` (Transformers 5),
parameter names included (its checkpoints name the stack ``backbone``).

Blocks (``config.layers_block_type``; ``hybrid_override_pattern`` ``M`` / ``*`` / ``-``): each is
``x + mixer(norm(x))`` with one mixer: ``linear_attention`` (Mamba2: ``in_proj`` to the gate,
``xBC`` and ``dt``; a depthwise causal ``conv1d`` with bias and SiLU over ``xBC``; the selective
state update with ``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)`` clamped to
``time_step_limit`` (the config's, default ``(0, inf)``: no clamp; ``time_step_min`` only initialises
``dt_bias``), ``D`` skip; a grouped RMSNorm of ``y * silu(gate)``; ``out_proj``), whose conv
window and ``[heads, head_dim, state_size]`` state live in ``pools.recurrent``; ``full_attention``
(q/k/v/o projections and paged attention, no RoPE); ``mlp`` (``down_proj(relu(up_proj(x))²)``).
MoE blocks are refused by name (their experts are not gated SwiGLUs, which ``kvjax.serve.moe`` is).

The recurrent state per sequence row comes from ``meta.state`` exactly as for Qwen3-Next
(``state_slots``, ``has_initial_state``, ``track_slots``, ``track_at``), run token by token with
``lax.scan`` by ``kvjax.attention.recurrent_step``.

Tensor parallelism (a recurrent pool sharded over ``"tp"``): the Mamba2 mixer is head-parallel, as
SGLang runs it. Each rank holds whole B/C groups with their heads: its rows of ``in_proj`` and its
conv channels (re-laid out rank-major at load by ``kvjax.serve.param_sharding``: its gate, x, B, C
and dt rows), its heads' ``A_log`` / ``dt_bias`` / ``D``, its groups' norm weight and its
``out_proj`` input columns. The mixer (``_local_mixer``) runs per rank inside ``shard_map`` over
the rank's state shard (the grouped RMSNorm stays per rank: whole groups) and ends in one
all-reduce of ``out_proj``'s partial sums (its bias added once, after). tp must divide
``n_groups``. Attention and MLP blocks (named ``mixer`` too) are split by the attention and MLP
rules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention import KindMetadata, attend, recurrent_step
from kvjax.attention.recurrent_step import recurrent_mixer_over_heads, state_mesh_axis, state_ranks
from kvjax.errors import ConfigError
from kvjax.pools import CachePools
from kvjax.serve.attention_block import project_output, project_qkv_heads
from kvjax.serve.causal_lm import CausalLM, LayerMixer, StackNames
from kvjax.serve.layers import BatchMetadata, Float32RMSNorm, Linear
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import param_spec
from kvjax.serve.recurrent_layers import Weight, WeightAndBias, conv_silu, decay_parameters, project
from kvjax.serve.trace_state import recurrent_trace_state
from kvjax.spec import ModelSpec

MAMBA, ATTENTION, MLP_BLOCK = "linear_attention", "full_attention", "mlp"
_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP_BLOCK, "E": "moe"}
_OLD_NAMES = {"mamba": MAMBA, "attention": ATTENTION}


@dataclasses.dataclass(frozen=True)
class NemotronHConfig:
    """The family's own hyperparameters (``ModelConfig.family_config``)."""

    block_types: tuple[str, ...]
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    time_step_limit: tuple[float, float]  # (lower, upper) clamp of dt after the softplus
    eps: float
    use_conv_bias: bool
    use_bias: bool

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size

    def layers(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.block_types) if t == kind)


def _time_step_limit(raw: Mapping[str, Any]) -> tuple[float, float]:
    """``time_step_limit`` (alias ``mamba_dt_limit``) as ``(lower, upper)``, Transformers' default
    ``(0, inf)`` when absent; a limit that is not two ordered numbers is refused by name.
    Transformers (5.25) writes an infinite bound as ``{"__float__": "Infinity"}``; a bare
    ``Infinity`` (Python's JSON) is a float already."""
    key = "time_step_limit" if "time_step_limit" in raw else "mamba_dt_limit"
    value = raw.get(key, (0.0, float("inf")))
    try:
        lower, upper = (float(v["__float__"] if isinstance(v, Mapping) else v) for v in value)
    except (KeyError, TypeError, ValueError):
        raise ConfigError(key, value, "give the dt clamp as two numbers [lower, upper]") from None
    if not lower <= upper:
        raise ConfigError(key, value, "the dt clamp's lower bound must not exceed its upper bound")
    return lower, upper


def read_config(spec: ModelSpec, raw: Mapping[str, Any]) -> NemotronHConfig:
    """Block types, Mamba2 dims and epsilons; refuse MoE blocks and activations other than
    ``silu`` (Mamba) / ``relu2`` (MLP)."""
    blocks = raw.get("layers_block_type")
    if blocks is None:
        blocks = [_PATTERN[c] for c in str(raw.get("hybrid_override_pattern", ""))]
    types = tuple(_OLD_NAMES.get(str(b), str(b)) for b in blocks)
    if "moe" in types:
        raise ConfigError(
            "layers_block_type",
            "moe",
            "kvjax's Nemotron-H model does not run MoE blocks (ungated ReLU² experts) yet; serve a config without them",
        )
    for key, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        if raw.get(key, want) != want:
            raise ConfigError(key, raw[key], f"kvjax's Nemotron-H model runs {key}={want!r} only")
    return NemotronHConfig(
        block_types=types,
        num_heads=int(raw["mamba_num_heads"]),
        head_dim=int(raw["mamba_head_dim"]),
        state_size=int(raw["ssm_state_size"]),
        n_groups=int(raw.get("n_groups", 1)),
        conv_kernel=int(raw.get("conv_kernel", 4)),
        time_step_limit=_time_step_limit(raw),
        eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        use_conv_bias=bool(raw.get("use_conv_bias", True)),
        use_bias=bool(raw.get("use_bias", False)),
    )


def _family(config: ModelConfig) -> NemotronHConfig:
    return config.family_settings(NemotronHConfig)


def trace_state(config: ModelConfig) -> tuple[CachePools, KindMetadata | None]:
    """The smallest pools of the model (one page, one state slot) and a one-row batch's metadata part."""
    fc = _family(config)
    return recurrent_trace_state(
        config,
        attention_layers=fc.layers(ATTENTION),
        recurrent_layers=fc.layers(MAMBA),
        conv_dim=fc.conv_dim,
        conv_kernel=fc.conv_kernel,
        ssm_state_shape=(fc.num_heads, fc.head_dim, fc.state_size),
    )


NemotronRMSNorm = Float32RMSNorm  # ``weight * x / rms(x)``, the product in float32, cast back


class Mamba2Mixer(LayerMixer):
    """The Mamba2 mixer, head-parallel over the recurrent state's mesh (module docstring): its
    weights are declared here, in Transformers' names and shapes, and applied per rank by
    ``_local_mixer`` inside ``recurrent_mixer_over_heads`` (the whole mixer at one rank)."""

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        fc = _family(c)
        dt_ = jnp.dtype(c.dtype)
        h, inter = fc.num_heads, fc.intermediate
        proj = inter + fc.conv_dim + h
        in_w, in_b = WeightAndBias((proj, x.shape[-1]), fc.use_bias, dt_, name="in_proj")()
        conv_w, conv_b = WeightAndBias((fc.conv_dim, 1, fc.conv_kernel), fc.use_conv_bias, dt_, name="conv1d")()
        out_w, out_b = WeightAndBias((c.hidden_size, inter), fc.use_bias, dt_, name="out_proj")()
        weights = {
            "in_proj/weight": in_w,
            "conv1d/weight": conv_w,
            "norm/weight": Weight((inter,), dt_, ones=True, name="norm")(),
            "out_proj/weight": out_w,
        }
        weights["dt_bias"], weights["A_log"] = decay_parameters(self, h, dt_)
        weights["D"] = self.param("D", nn.initializers.ones, (h,), dt_)
        for name, bias in (("in_proj/bias", in_b), ("conv1d/bias", conv_b)):
            if bias is not None:
                weights[name] = bias
        ranks = state_ranks(pools)
        if fc.n_groups % ranks:
            raise ConfigError(
                "tp_size",
                ranks,
                f"the Mamba2 mixer's {fc.n_groups} B/C groups do not split over {ranks} ranks (each rank runs whole "
                "groups with their heads); use a tp size that divides n_groups",
            )
        axis = state_mesh_axis(pools)  # ("tp", "dcp") under DCP: the weights' own split
        specs = {name: param_spec(f"mixer/{name}", w.shape, c, ranks, axis=axis) for name, w in weights.items()}
        mixer = functools.partial(_local_mixer, fc=fc, layer_id=self.layer_id, dtype=dt_)
        out, pools = recurrent_mixer_over_heads(pools, mixer, x, weights, specs, meta)
        return (out if out_b is None else out + out_b), pools  # the row-parallel bias: once, after the sum


def _local_mixer(
    pools: CachePools,
    x: jax.Array,
    w: dict[str, jax.Array],
    meta: BatchMetadata,
    *,
    fc: NemotronHConfig,
    layer_id: int,
    dtype: jnp.dtype,
) -> tuple[jax.Array, CachePools]:
    """The Mamba2 mixer on one rank's heads (all of them at one rank): ``w`` holds the rank's
    slices (its rows of ``in_proj`` and conv channels, re-laid out rank-major at load: its gate, x,
    B, C and dt rows; its heads' ``A_log``/``dt_bias``/``D``, norm weight and ``out_proj`` columns),
    ``pools.recurrent`` the rank's state shard. Returns the rank's partial ``out_proj`` sum (no bias)."""
    h = w["A_log"].shape[0]  # this rank's heads
    g = fc.n_groups * h // fc.num_heads  # and B/C groups
    p, n = fc.head_dim, fc.state_size
    inter = h * p
    conv_dim = inter + 2 * g * n
    t = x.shape[0]
    proj = project(x, w["in_proj/weight"])
    if "in_proj/bias" in w:
        proj = proj + w["in_proj/bias"]
    gate, xbc, dt_raw = proj[:, :inter], proj[:, inter : inter + conv_dim], proj[:, inter + conv_dim :]
    w32 = w["conv1d/weight"][:, 0, :].astype(jnp.float32)
    b32 = w["conv1d/bias"].astype(jnp.float32) if "conv1d/bias" in w else None
    a = -jnp.exp(w["A_log"].astype(jnp.float32))
    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + w["dt_bias"].astype(jnp.float32))
    dt = jnp.clip(dt, *fc.time_step_limit)
    d_skip = w["D"].astype(jnp.float32)
    per = h // g

    def update(window: jax.Array, ssm: jax.Array, dt_t: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = conv_silu(window, w32, b32, dtype)
        xs = y[:inter].reshape(h, p)
        b_t = jnp.repeat(y[inter : inter + g * n].reshape(g, n), per, axis=0)  # [H, N]
        c_t = jnp.repeat(y[inter + g * n :].reshape(g, n), per, axis=0)
        st = ssm * jnp.exp(dt_t * a)[:, None, None] + (dt_t[:, None] * xs)[:, :, None] * b_t[:, None, :]
        out = jnp.einsum("hpn,hn->hp", st, c_t) + d_skip[:, None] * xs
        return st, out.reshape(inter)

    y, pools = recurrent_step(pools, layer_id, xbc, (dt,), update, meta)
    # Grouped RMSNorm of y * silu(gate), in float32 (each rank holds whole groups).
    z = y.astype(dtype).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    zg = z.reshape(t, g, inter // g)
    zg = zg * jax.lax.rsqrt(jnp.mean(zg * zg, axis=-1, keepdims=True) + fc.eps)
    normed = w["norm/weight"] * zg.reshape(t, inter).astype(dtype)
    return project(normed, w["out_proj/weight"]), pools


class NemotronAttention(LayerMixer):
    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        q, k, v = project_qkv_heads(self.config, x, use_bias=False)
        out, pools = attend(pools, self.layer_id, q, k, v, meta)
        return project_output(self.config, out, use_bias=False), pools


class ReluSquaredMLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = jnp.dtype(c.dtype)
        up = Linear(c.intermediate_size, c.mlp_bias, dt, name="up_proj")(x)
        return Linear(c.hidden_size, c.mlp_bias, dt, name="down_proj")(jnp.square(jax.nn.relu(up)))


class NemotronHBlock(nn.Module):
    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        fc = _family(c)
        h = NemotronRMSNorm(fc.eps, jnp.dtype(c.dtype), name="norm")(x)
        kind = fc.block_types[self.layer_id]
        if kind == MAMBA:
            h, pools = Mamba2Mixer(c, self.layer_id, name="mixer")(h, pools, meta)
        elif kind == ATTENTION:
            h, pools = NemotronAttention(c, self.layer_id, name="mixer")(h, pools, meta)
        else:
            h = ReluSquaredMLP(c, name="mixer")(h)
        return x + h, pools


class NemotronHForCausalLM(CausalLM):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    decoder_layer: type[nn.Module] = NemotronHBlock
    final_norm: type[nn.Module] = NemotronRMSNorm
    names: StackNames = StackNames(stack="backbone", embed="embeddings", norm="norm_f")

    @nn.nowrap
    def final_norm_eps(self) -> float:
        return _family(self.config).eps


__all__ = ["NemotronHConfig", "NemotronHForCausalLM", "read_config", "trace_state"]
