"""`ModelSpec`: what a model's layers need cached, independent of any weights.

A spec is built from a Hugging Face ``config.json`` (``ModelSpec.from_hf_config``) or from a
shipped preset (``ModelSpec.preset("llama-3-8b")``). It is a frozen dataclass: hashable,
comparable, and safe to share between plans.

Invariants (checked in ``__post_init__``):
  * ``len(layer_kinds) == num_hidden_layers``;
  * ``sliding_window`` is set iff some layer is ``LayerKind.SLIDING``;
  * ``recurrent`` is set iff some layer keeps a recurrent state (``RECURRENT`` or
    ``FULL_AND_RECURRENT``);
  * MLA layers need ``kv_lora_rank`` and ``qk_rope_head_dim``.

Consumers ask :meth:`ModelSpec.attention_layer_ids` and :meth:`ModelSpec.recurrent_layer_ids`,
never ``layer_kinds`` directly: a Falcon-H1 layer is in both, a Nemotron-H MLP layer in neither.

The parsing lives in ``kvjax.hf`` (one module per family group), which returns plain keyword
arguments; this module imports it, never the reverse, so there is no import cycle.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvjax.errors import ConfigError
from kvjax.hf import parse_hf_fields
from kvjax.layer_kinds import LayerKind, RecurrentStateSpec, dtype_bytes

__all__ = ["LayerKind", "ModelSpec", "RecurrentStateSpec", "dtype_bytes"]


@dataclass(frozen=True)
class ModelSpec:
    """The cache-relevant facts of a decoder model.

    Units: head dims and hidden sizes in elements; ``sliding_window`` and ``context_length`` in tokens.
    ``head_dim`` is the K head dim and ``v_head_dim`` the V head dim (they differ for some models).
    For MLA layers the cached row is ``kv_lora_rank + qk_rope_head_dim`` elements and ``num_kv_heads`` is 1.
    ``attention_sinks``: the attention layers add a learned per-head sink logit (gpt-oss); it is a
    weight, so it changes no cache size. Linear attention is recorded in ``recurrent.mixer``
    (``"lightning"``). ``warnings`` are the assumptions the parser made (a missing
    ``num_key_value_heads`` planned as MHA, an unknown ``model_type`` read from the standard keys);
    the planner copies them into the plan. They do not take part in equality.
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
    attention_sinks: bool = False
    warnings: tuple[str, ...] = field(default=(), compare=False)
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_kinds", tuple(LayerKind(k) for k in self.layer_kinds))
        object.__setattr__(self, "architectures", tuple(self.architectures))
        object.__setattr__(self, "warnings", tuple(self.warnings))
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
        if bool(self.recurrent_layer_ids()) != (self.recurrent is not None):
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
        layer that caches attention *and* a recurrent state (``FULL_AND_RECURRENT``) counts here
        under FULL and in :meth:`recurrent_layer_ids`; a ``NONE`` layer counts nowhere."""
        kind = LayerKind(kind)
        if kind.attention is not kind:
            raise ConfigError("kind", kind.value, "ask for an attention kind: full_attention, sliding_attention or mla")
        return tuple(i for i, k in enumerate(self.layer_kinds) if k.attention is kind)

    def recurrent_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the layers that hold a per-request recurrent state, ascending."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k.has_recurrent_state)

    @property
    def is_mla(self) -> bool:
        return LayerKind.MLA in self.layer_kinds

    @property
    def has_sliding_layers(self) -> bool:
        return LayerKind.SLIDING in self.layer_kinds

    @property
    def uses_ssm_state(self) -> bool:
        """True for hybrid SSM / linear-attention models (SGLang's ``is_hybrid_ssm``)."""
        return self.recurrent is not None

    @property
    def num_kv_layers(self) -> int:
        """Layers that cache per-token K/V (full, sliding or MLA; Falcon-H1's hybrid layers included)."""
        return sum(1 for k in self.layer_kinds if k.attention is not None)

    @property
    def num_recurrent_layers(self) -> int:
        """Layers that keep a per-request recurrent state."""
        return len(self.recurrent_layer_ids())

    @property
    def uses_linear_attention(self) -> bool:
        """True when the recurrent layers are lightning (linear) attention (MiniMax)."""
        return self.recurrent is not None and self.recurrent.mixer == "lightning"

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, name: str | None = None) -> ModelSpec:
        """Parse a Hugging Face ``config.json`` dict (``kvjax.hf`` lists the families).

        ``name`` defaults to the config's ``_name_or_path``, else its ``model_type``. The raw config
        is kept, deep-copied, in ``spec.extra``. Raises `ConfigError` naming the key for an unusable
        config (every missing required key at once) or a family kvjax cannot describe.
        """
        if not isinstance(config, Mapping):
            raise ConfigError("config", type(config).__name__, "pass the parsed config.json as a dict")
        model_type, fields = parse_hf_fields(config)
        spec_name = name or config.get("_name_or_path") or model_type
        return cls(name=str(spec_name), model_type=model_type, extra=copy.deepcopy(dict(config)), **fields)

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelSpec:
        """Parse a ``config.json`` file; the spec is named after the file's folder."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError("model", str(path), "no such file; pass a preset name or the path of a config.json")
        try:
            config = json.loads(path.read_text())
        except OSError as e:
            raise ConfigError(
                "model", str(path), f"cannot read the file ({e.strerror}); check its permissions"
            ) from None
        except json.JSONDecodeError as e:
            raise ConfigError(
                "model", str(path), f"not valid JSON (line {e.lineno}: {e.msg}); pass a Hugging Face config.json"
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(
                "model", str(path), "not a text file; pass a Hugging Face config.json or a .gguf file"
            ) from None
        if not isinstance(config, dict):
            raise ConfigError("model", str(path), "the file holds no JSON object; pass a Hugging Face config.json")
        stem = path.parent.name if path.name == "config.json" else path.stem
        return cls.from_hf_config(config, name=stem or None)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelSpec:
        """A shipped preset by name (``ModelSpec.presets()`` lists them).

        ``overrides`` replace keys of the preset's Hugging Face ``config.json`` (Hugging Face's
        names: ``num_hidden_layers``, ``num_key_value_heads``, ``layer_types``, ...) before it is
        read, for a variant of a shipped model: ``ModelSpec.preset("gemma3-tiny",
        num_hidden_layers=6, layer_types=[...])``. The variant is named ``"<name>-custom"``.
        """
        names = cls.presets()
        if name not in names:
            raise ConfigError("model", name, f"use a preset name from {list(names)} or a path to a config.json")
        config = json.loads(resources.files("kvjax.presets").joinpath(f"{name}.json").read_text())
        return cls.from_hf_config({**config, **overrides}, name=f"{name}-custom" if overrides else name)

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names of the shipped presets, sorted."""
        files = resources.files("kvjax.presets").iterdir()
        return tuple(sorted(f.name[: -len(".json")] for f in files if f.name.endswith(".json")))

    @classmethod
    def resolve(cls, model: str) -> ModelSpec:
        """A preset name, a path to a ``config.json``, or a GGUF model (a ``.gguf`` file, a directory
        holding one, an installed model's name: ``kvjax.gguf.locate``; its metadata read, no
        tensor): what the command line accepts."""
        from kvjax.gguf.locate import gguf_path

        if model in cls.presets():
            return cls.preset(model)
        gguf = gguf_path(model)
        if gguf is not None:
            from kvjax.gguf.config import hf_config
            from kvjax.gguf.locate import model_name
            from kvjax.gguf.reader import read_gguf

            return cls.from_hf_config(hf_config(read_gguf(gguf)), name=model_name(gguf))
        path = Path(model)
        if path.exists() or path.suffix == ".json" or len(path.parts) > 1:
            return cls.from_json_file(path)
        raise ConfigError(
            "model",
            model,
            f"no such preset or file; use a preset from {list(cls.presets())}, a config.json path or a .gguf file",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (layer kinds as strings)."""
        d = asdict(self)
        d.pop("extra")
        d["warnings"] = list(self.warnings)
        d["layer_kinds"] = [k.value for k in self.layer_kinds]
        d["architectures"] = list(self.architectures)
        return d
