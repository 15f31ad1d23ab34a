"""`ModelSpec`: what a model's layers need cached, independent of any weights.

A spec is built from a Hugging Face ``config.json`` (``ModelSpec.from_hf_config``) or from a
shipped preset (``ModelSpec.preset("llama-3-8b")``). It is a frozen dataclass: hashable,
comparable, and safe to share between plans.

Invariants (checked in ``__post_init__``):
  * ``len(layer_kinds) == num_hidden_layers``;
  * ``sliding_window`` is set iff some layer is ``LayerKind.SLIDING``;
  * ``recurrent`` is set iff some layer is ``LayerKind.RECURRENT``;
  * MLA layers need ``kv_lora_rank`` and ``qk_rope_head_dim``.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvjax.errors import ConfigError


class LayerKind(str, enum.Enum):
    """What one decoder layer keeps between steps."""

    FULL = "full_attention"  # K and V for every token
    SLIDING = "sliding_attention"  # K and V for the last ``sliding_window`` tokens
    MLA = "mla"  # one latent row per token: kv_lora_rank + qk_rope_head_dim
    RECURRENT = "recurrent"  # a fixed-size conv + SSM state per request (Mamba, GDN, linear attention)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as kvjax names them (``"bfloat16"``, ``"fp8_e4m3"``, ...)."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError("dtype", dtype, f"use one of {sorted(_DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Per-request state of one recurrent (SSM / linear-attention) layer.

    Shapes exclude the leading ``[num_layers, num_slots]`` axes of the state pool.
    ``conv_state_shapes`` holds one shape per conv tensor (Mamba2 has one, GDN may have several).
    """

    conv_state_shapes: tuple[tuple[int, ...], ...]
    conv_dtype: str
    ssm_state_shape: tuple[int, ...]
    ssm_dtype: str

    def bytes_per_slot(self) -> int:
        """Bytes of one request's state in one layer (all conv tensors plus the SSM tensor)."""
        conv = sum(math.prod(s) for s in self.conv_state_shapes) * dtype_bytes(self.conv_dtype)
        return conv + math.prod(self.ssm_state_shape) * dtype_bytes(self.ssm_dtype)


@dataclass(frozen=True)
class ModelSpec:
    """The cache-relevant facts of a decoder model.

    Units: head dims and hidden sizes in elements; ``sliding_window`` and ``context_length`` in tokens.
    ``head_dim`` is the K head dim and ``v_head_dim`` the V head dim (they differ for some models).
    For MLA layers the cached row is ``kv_lora_rank + qk_rope_head_dim`` elements and ``num_kv_heads`` is 1.
    """

    name: str
    model_type: str
    architectures: tuple[str, ...]
    num_hidden_layers: int
    layer_kinds: tuple[LayerKind, ...]
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int
    dtype: str = "bfloat16"
    sliding_window: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    is_dsa: bool = False
    index_head_dim: int | None = None
    recurrent: RecurrentStateSpec | None = None
    is_multimodal: bool = False
    num_nextn_predict_layers: int = 0
    attn_logit_softcapping: float | None = None
    rope_theta: float = 10000.0
    intermediate_size: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_kinds", tuple(LayerKind(k) for k in self.layer_kinds))
        object.__setattr__(self, "architectures", tuple(self.architectures))
        if self.num_hidden_layers <= 0:
            raise ConfigError("num_hidden_layers", self.num_hidden_layers, "a model needs at least one layer")
        if len(self.layer_kinds) != self.num_hidden_layers:
            raise ConfigError(
                "layer_kinds",
                f"{len(self.layer_kinds)} entries",
                f"give exactly one kind per layer (num_hidden_layers={self.num_hidden_layers})",
            )
        has_sliding = LayerKind.SLIDING in self.layer_kinds
        if has_sliding and not (self.sliding_window and self.sliding_window > 0):
            raise ConfigError("sliding_window", self.sliding_window, "sliding layers need a positive window size")
        if not has_sliding and self.sliding_window is not None:
            raise ConfigError("sliding_window", self.sliding_window, "set it only when some layer is sliding")
        if (LayerKind.RECURRENT in self.layer_kinds) != (self.recurrent is not None):
            raise ConfigError(
                "recurrent", self.recurrent, "recurrent layers need a RecurrentStateSpec, and only they do"
            )
        if LayerKind.MLA in self.layer_kinds and not (self.kv_lora_rank and self.qk_rope_head_dim):
            raise ConfigError("kv_lora_rank", self.kv_lora_rank, "MLA layers need kv_lora_rank and qk_rope_head_dim")
        for name in ("num_kv_heads", "head_dim", "v_head_dim", "context_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be a positive integer")
        dtype_bytes(self.dtype)

    # --- layer counts -------------------------------------------------------------------------

    def count(self, kind: LayerKind) -> int:
        """Number of layers of one kind."""
        return sum(1 for k in self.layer_kinds if k == kind)

    def layer_ids(self, kind: LayerKind) -> tuple[int, ...]:
        """Global ids of the layers of one kind, ascending."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    def attention_layer_ids(self, kind: LayerKind) -> tuple[int, ...]:
        """Global ids of the layers whose per-token attention cache is of ``kind`` (FULL, SLIDING or
        MLA), ascending. The planner and the build ask this, never ``layer_kinds`` directly, so a
        layer kind that caches attention *and* a recurrent state counts here and in
        :meth:`recurrent_layer_ids`."""
        return self.layer_ids(kind)

    def recurrent_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the layers that hold a per-request recurrent state, ascending."""
        return self.layer_ids(LayerKind.RECURRENT)

    @property
    def is_mla(self) -> bool:
        return LayerKind.MLA in self.layer_kinds

    @property
    def has_sliding_layers(self) -> bool:
        return LayerKind.SLIDING in self.layer_kinds

    @property
    def uses_ssm_state(self) -> bool:
        """True for hybrid SSM / linear-attention models (SGLang's ``is_hybrid_ssm``)."""
        return LayerKind.RECURRENT in self.layer_kinds

    @property
    def num_kv_layers(self) -> int:
        """Layers that cache per-token K/V (full, sliding or MLA)."""
        return self.num_hidden_layers - self.count(LayerKind.RECURRENT)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, name: str | None = None) -> ModelSpec:
        """Parse a Hugging Face ``config.json`` dict (see ``kvjax.hf_config`` for the families)."""
        from kvjax.hf_config import parse_hf_config

        return parse_hf_config(config, name=name)

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelSpec:
        """Parse a ``config.json`` file; the spec is named after the file's folder."""
        path = Path(path)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError("model", str(path), f"pass a readable Hugging Face config.json ({e})") from None
        stem = path.parent.name if path.name == "config.json" else path.stem
        return cls.from_hf_config(config, name=stem or None)

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """A shipped preset by name (``ModelSpec.presets()`` lists them)."""
        names = cls.presets()
        if name not in names:
            raise ConfigError("model", name, f"use a preset name from {list(names)} or a path to a config.json")
        text = resources.files("kvjax.presets").joinpath(f"{name}.json").read_text()
        return cls.from_hf_config(json.loads(text), name=name)

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names of the shipped presets, sorted."""
        files = resources.files("kvjax.presets").iterdir()
        return tuple(sorted(f.name[: -len(".json")] for f in files if f.name.endswith(".json")))

    @classmethod
    def resolve(cls, model: str) -> ModelSpec:
        """A preset name or a path to a ``config.json`` (what the command line accepts)."""
        if model in cls.presets():
            return cls.preset(model)
        if Path(model).exists():
            return cls.from_json_file(model)
        raise ConfigError("model", model, f"use a preset name from {list(cls.presets())} or a path to a config.json")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (layer kinds as strings)."""
        d = asdict(self)
        d.pop("extra")
        d["layer_kinds"] = [k.value for k in self.layer_kinds]
        d["architectures"] = list(self.architectures)
        return d
