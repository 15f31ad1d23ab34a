"""CLIP's vision tower (Transformers' ``CLIPVisionModel``), the image encoder of LLaVA-style models.

Architecture, parameter names included (the names are the checkpoint's under the tower's prefix):

* ``embeddings``: ``patch_embedding.weight`` ``[hidden, channels, patch, patch]`` (a convolution
  of stride ``patch``, no bias, cutting the image into ``(image_size // patch) ** 2`` patches, row
  by row), ``class_embedding`` ``[hidden]`` (prepended: position 0), ``position_embedding.weight``
  ``[1 + patches, hidden]`` (added to every position);
* ``pre_layrnorm`` (LayerNorm, Transformers' spelling);
* ``encoder.layers_{i}``: ``layer_norm1``, ``self_attn`` (``q_proj``, ``k_proj``, ``v_proj``,
  ``out_proj``, all with biases; bidirectional, scale ``head_dim ** -0.5``), residual,
  ``layer_norm2``, ``mlp`` (``fc1``, ``hidden_act``, ``fc2``), residual;
* ``post_layernorm``: only on the pooled output, which LLaVA does not read (never built here).

The tower returns one entry of Transformers' ``hidden_states`` tuple: entry 0 is the
``pre_layrnorm`` output, entry ``k`` the output of encoder layer ``k - 1``; a negative index counts
from the end (``-1``: the last layer, ``-2``: LLaVA's default, the one before). Only the layers up
to the chosen one run (as SGLang, which builds only those).

Shapes: ``pixel_values`` ``[N, channels, image_size, image_size]`` (the preprocessor's output, NCHW),
result ``[N, 1 + patches, hidden]`` in the weights' dtype. Images of another size than
``image_size`` are refused (Transformers would interpolate the position embeddings; kvjax does not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.serve.layers import WEIGHT_INIT_STDDEV, Linear

__all__ = ["ACTIVATIONS", "ClipVisionConfig", "ClipVisionTower", "activation"]


def _quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


#: The activations of Transformers' ``ACT2FN`` the tower and the projector may name.
ACTIVATIONS: Mapping[str, Callable[[jax.Array], jax.Array]] = {
    "quick_gelu": _quick_gelu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def activation(name: Any, key: str) -> Callable[[jax.Array], jax.Array]:
    """The activation ``name`` of config key ``key``; `ConfigError` naming the supported ones."""
    fn = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if fn is None:
        raise ConfigError(key, name, f"kvjax's vision encoder runs the activations {sorted(ACTIVATIONS)}")
    return fn


@dataclasses.dataclass(frozen=True)
class ClipVisionConfig:
    """A CLIP vision tower's hyperparameters (``vision_config`` of a LLaVA ``config.json``; dims in
    elements, sizes in pixels)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "vision_config") -> ClipVisionConfig:
        """Read ``raw`` (Transformers' ``CLIPVisionConfig`` keys; missing ones take its defaults).

        Raises:
            ConfigError: a ``model_type`` other than ``clip_vision_model`` (a tower kvjax does not
                serve), a non-positive dim, heads that do not divide ``hidden_size``, an image size
                the patch size does not divide, or an unsupported ``hidden_act``.
        """
        model_type = raw.get("model_type", "clip_vision_model")
        if model_type != "clip_vision_model":
            raise ConfigError(
                f"{where}.model_type",
                model_type,
                "kvjax serves LLaVA with a CLIP vision tower (clip_vision_model) only",
            )
        defaults = cls()
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            value = raw.get(field.name)
            values[field.name] = getattr(defaults, field.name) if value is None else value
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels"):
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{where}.{name}", value, "must be a positive integer")
        if values["hidden_size"] % values["num_attention_heads"]:
            raise ConfigError(f"{where}.num_attention_heads", values["num_attention_heads"], "must divide hidden_size")
        size, patch = values["image_size"], values["patch_size"]
        if not isinstance(size, int) or not isinstance(patch, int) or patch <= 0 or size <= 0 or size % patch:
            raise ConfigError(f"{where}.image_size", size, f"must be a positive multiple of patch_size {patch}")
        activation(values["hidden_act"], f"{where}.hidden_act")
        values["layer_norm_eps"] = float(values["layer_norm_eps"])
        return cls(**values)

    @property
    def num_patches(self) -> int:
        """Patches per image, ``(image_size // patch_size) ** 2``."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def hidden_state_index(self, feature_layer: int) -> int:
        """The entry of the ``hidden_states`` tuple (``0 .. num_hidden_layers``) that
        ``feature_layer`` names (negative: from the end); `ConfigError` when out of range."""
        n = self.num_hidden_layers
        if isinstance(feature_layer, bool) or not isinstance(feature_layer, int) or not -(n + 1) <= feature_layer <= n:
            raise ConfigError(
                "vision_feature_layer",
                feature_layer,
                f"name one of the tower's {n + 1} hidden states: an int in [{-(n + 1)}, {n}]",
            )
        return feature_layer % (n + 1)


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis, in float32, cast back."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class Weight(nn.Module):
    """A module holding one ``weight`` of ``shape`` (a convolution's kernel, an embedding table)."""

    shape: tuple[int, ...]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("weight", nn.initializers.normal(WEIGHT_INIT_STDDEV), self.shape, self.dtype)


class ClipEmbeddings(nn.Module):
    """Patches, class token and positions: ``[N, C, H, W] -> [N, 1 + patches, hidden]``."""

    config: ClipVisionConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        c = self.config
        d, p = c.hidden_size, c.patch_size
        kernel = Weight((d, c.num_channels, p, p), self.dtype, name="patch_embedding")()
        patches = jax.lax.conv_general_dilated(
            pixel_values.astype(self.dtype),
            kernel,
            window_strides=(p, p),
            padding="VALID",
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        )  # [N, hidden, H/p, W/p]
        n = patches.shape[0]
        patches = patches.reshape(n, d, -1).transpose(0, 2, 1)  # row-major patches, as torch's flatten(2)
        cls = self.param("class_embedding", nn.initializers.normal(WEIGHT_INIT_STDDEV), (d,), self.dtype)
        positions = Weight((c.num_patches + 1, d), self.dtype, name="position_embedding")()
        x = jnp.concatenate([jnp.broadcast_to(cls, (n, 1, d)), patches], axis=1)
        return x + positions[None]


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention over one image's positions (softmax in float32)."""

    config: ClipVisionConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        n, length, d = x.shape
        heads, hd = c.num_attention_heads, c.head_dim

        def project(name: str) -> jax.Array:
            return Linear(d, True, self.dtype, name=name)(x).reshape(n, length, heads, hd)

        q, k, v = project("q_proj"), project("k_proj"), project("v_proj")
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k).astype(jnp.float32) * hd**-0.5
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, length, d)
        return Linear(d, True, self.dtype, name="out_proj")(out)


class ClipEncoderLayer(nn.Module):
    """``x + attn(layer_norm1(x))``, then ``x + fc2(act(fc1(layer_norm2(x))))``."""

    config: ClipVisionConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = x + ClipAttention(c, self.dtype, name="self_attn")(
            LayerNorm(c.layer_norm_eps, self.dtype, name="layer_norm1")(x)
        )
        h = LayerNorm(c.layer_norm_eps, self.dtype, name="layer_norm2")(x)
        mlp = ClipMLP(c, self.dtype, name="mlp")
        return x + mlp(h)


class ClipMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with biases."""

    config: ClipVisionConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        act = activation(c.hidden_act, "vision_config.hidden_act")
        h = act(Linear(c.intermediate_size, True, self.dtype, name="fc1")(x))
        return Linear(c.hidden_size, True, self.dtype, name="fc2")(h)


class ClipEncoder(nn.Module):
    """The first ``num_layers`` encoder layers (``layers_{i}``)."""

    config: ClipVisionConfig
    num_layers: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.num_layers):
            x = ClipEncoderLayer(self.config, self.dtype, name=f"layers_{i}")(x)
        return x


class ClipVisionTower(nn.Module):
    """``pixel_values [N, C, H, W] -> hidden_states[feature_layer] [N, 1 + patches, hidden]``
    (module docstring); ``feature_layer`` as Transformers' ``vision_feature_layer``."""

    config: ClipVisionConfig
    feature_layer: int = -2
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        c = self.config
        want = (c.num_channels, c.image_size, c.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != want:
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)}: the tower takes [images, {want[0]}, {want[1]}, "
                f"{want[2]}] (preprocess each image to image_size {c.image_size})"
            )
        x = ClipEmbeddings(c, self.dtype, name="embeddings")(pixel_values)
        x = LayerNorm(c.layer_norm_eps, self.dtype, name="pre_layrnorm")(x)
        return ClipEncoder(c, c.hidden_state_index(self.feature_layer), self.dtype, name="encoder")(x)
