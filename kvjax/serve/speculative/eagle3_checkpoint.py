"""Reading an EAGLE3 draft checkpoint (``--speculative-draft-model-path DIR`` with
``--speculative-algorithm EAGLE3``): a ``config.json`` naming ``LlamaForCausalLMEagle3`` and
safetensors in the names SGLang's ``llama_eagle3.py`` loads.

Tensors (each looked up as written, then with a ``model.`` prefix; ``midlayer.*`` also as
``layers.0.*``, and ``fc_norm.{0,1,2}`` also as the older ``aux_norm_{low,mid,high}``, as SGLang
renames them): ``fc.weight`` ``[hidden, n * target_hidden]`` (and ``fc.bias`` with ``bias``),
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v}_proj.weight`` ``[*, 2 * hidden]``, ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``
``[draft_vocab_size, hidden]`` and ``d2t`` ``[draft_vocab_size]`` (target id minus draft id);
``input_norm.weight`` with ``norm_before_fc``, ``fc_norm.i.weight`` with ``fc_norm`` /
``use_aux_norm``. ``embed_tokens`` and ``t2d`` are not read (the embedding is the target's, as
SGLang's ``set_embed`` shares it; SGLang skips ``t2d`` too). Without ``draft_vocab_size`` the
target's head serves and neither ``lm_head`` nor ``d2t`` is read.

What must fit the target (each a ``ConfigError`` naming ``speculative_draft_model_path`` and the
key, before any tensor data is read): a target family EAGLE3 is served for
(``EAGLE3_FAMILIES``), one layer, the target's ``hidden_size`` (and ``target_hidden_size`` when
given), ``vocab_size`` (the shared embedding), ``num_key_value_heads`` and ``head_dim`` (the draft
pool is planned in the target's attention layout), ``draft_vocab_size`` at most ``vocab_size``,
captured boundaries within the target (``eagle3_draft.capture_boundaries``), aux hidden states
used (``eagle_config.use_aux_hidden_state`` not false), an untied draft (a tied one would read the
target's embedding as its head, not its ``lm_head``). A tensor of another shape is refused naming
it; ``d2t`` mapping outside the target's vocabulary too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax.errors import ConfigError
from kvjax.serve.model_config import ModelConfig, model_config_from_spec
from kvjax.serve.speculative.eagle3_draft import Eagle3Config, capture_boundaries, eagle3_param_shapes
from kvjax.serve.speculative.nextn import NextNDraftModel
from kvjax.spec import ModelSpec

__all__ = [
    "EAGLE3_ARCHITECTURE",
    "EAGLE3_FAMILIES",
    "eagle3_config",
    "eagle3_params",
    "eagle3_tensor_names",
    "check_eagle3_fits",
    "is_eagle3_draft",
    "load_eagle3_draft",
]

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE3_FAMILIES = ("llama", "gpt_oss")
"""The target families EAGLE3 drafts are served for: full-attention Llama-like targets, and gpt-oss
(hybrid sliding-window: the draft's one layer is full attention over ``kv_draft``, planned as a
STANDALONE draft's pool over the allocator's slots, ``kvjax.plan.draft``)."""
_WINDOWED_FAMILIES = ("gpt_oss",)  # served with their sliding windows

_SHARED = ("embed_tokens",)  # the target's
_LEGACY_FC_NORMS = ("aux_norm_low", "aux_norm_mid", "aux_norm_high")


def is_eagle3_draft(directory: str | Path) -> bool:
    """Whether ``directory``'s ``config.json`` names the EAGLE3 draft's architecture."""
    file = Path(directory) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and EAGLE3_ARCHITECTURE in (raw.get("architectures") or [])


def _refuse(path: Any, why: str) -> ConfigError:
    return ConfigError("speculative_draft_model_path", str(path), why)


def eagle3_config(
    target: ModelConfig, raw: Mapping[str, Any], target_raw: Mapping[str, Any], path: Any
) -> Eagle3Config:
    """The `Eagle3Config` of the draft whose ``config.json`` is ``raw`` for ``target`` (whose own
    ``config.json`` is ``target_raw``); ``ConfigError`` for what does not fit (module docstring)."""
    windows = target.family_config is not None and target.family not in _WINDOWED_FAMILIES
    if target.family not in EAGLE3_FAMILIES or windows:
        raise _refuse(
            path,
            f"EAGLE3 drafts ({EAGLE3_ARCHITECTURE}) are served for {list(EAGLE3_FAMILIES)} targets (Llama with full "
            f"attention), not a {target.family!r} one{' with sliding windows' if windows else ''}",
        )
    layers = int(raw.get("num_hidden_layers") or 0)
    if layers != 1:
        raise _refuse(path, f"the EAGLE3 draft has num_hidden_layers={layers}; kvjax serves one-layer EAGLE3 drafts")
    eagle_config = raw.get("eagle_config") or {}
    if isinstance(eagle_config, Mapping) and eagle_config.get("use_aux_hidden_state", True) is False:
        raise _refuse(path, "eagle_config.use_aux_hidden_state is false; kvjax's EAGLE3 reads the captured layers")
    if raw.get("tie_word_embeddings"):
        raise _refuse(path, "the EAGLE3 draft ties its head to the embedding; kvjax serves drafts with an lm_head")
    target_hidden = raw.get("target_hidden_size") or target.hidden_size
    wants = {
        "hidden_size": (raw.get("hidden_size"), target.hidden_size),
        "target_hidden_size": (target_hidden, target.hidden_size),
        "vocab_size": (raw.get("vocab_size"), target.vocab_size),
        "num_key_value_heads": (raw.get("num_key_value_heads"), target.num_kv_heads),
    }
    for key, (got, want) in wants.items():
        if got is not None and int(got) != want:
            raise _refuse(
                path,
                f"the EAGLE3 draft's {key} is {got}, the target's {want}: give a draft trained for this target",
            )
    # the draft's layer is a full-attention Llama layer whatever its config says of windows
    unwindowed = dict(raw, sliding_window=None, layer_types=None, use_sliding_window=False)
    spec = ModelSpec.from_hf_config(dict(unwindowed, model_type="llama", architectures=["LlamaForCausalLM"]))
    layer = model_config_from_spec(spec, dtype=target.dtype)
    if layer.head_dim != target.head_dim:
        raise _refuse(path, f"the EAGLE3 draft's head_dim is {layer.head_dim}, the target's {target.head_dim}")
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and not 0 < int(draft_vocab) <= target.vocab_size:
        raise _refuse(path, f"draft_vocab_size={draft_vocab}: give 1..{target.vocab_size} (the target's vocab_size)")
    own_head = draft_vocab is not None
    layer = layer.replace(
        num_hidden_layers=1,
        vocab_size=int(draft_vocab) if draft_vocab is not None else target.vocab_size,
        tie_word_embeddings=not own_head and target.tie_word_embeddings,
        family_config=None,
    )
    return Eagle3Config(
        layer=layer,
        embed_vocab_size=target.vocab_size,
        capture=capture_boundaries(target.family, target.num_hidden_layers, raw, path),
        target_hidden_size=int(target_hidden),
        fc_bias=bool(raw.get("bias", False)),
        norm_before_fc=bool(eagle_config.get("norm_before_fc", raw.get("norm_before_fc", False))),
        fc_norm=bool(raw.get("fc_norm") or raw.get("use_aux_norm", False)),
        norm_output=bool(raw.get("norm_output", False)),
        token_map=own_head,
        own_head=own_head,
    )


def _param_name(path: tuple[str, ...]) -> str:
    from kvjax.serve.checkpoint import param_name

    return param_name(path)


def eagle3_tensor_names(config: Eagle3Config) -> dict[tuple[str, ...], str]:
    """The checkpoint name of every parameter the draft reads (its own: not the shared embedding,
    nor the target's head when it has none), in the names SGLang's loader expects first."""
    from kvjax.serve.checkpoint import flatten_params

    names = {}
    for path, _ in flatten_params(eagle3_param_shapes(config)):
        if path[0] in _SHARED or (path[0] == "lm_head" and not config.own_head):
            continue
        names[path] = _param_name(path)
    return names


def _candidates(name: str) -> list[str]:
    """The names a checkpoint may store ``name`` under (module docstring)."""
    forms = [name]
    if name.startswith("midlayer."):
        forms.append("layers.0." + name[len("midlayer.") :])
    if name.startswith("fc_norm."):
        index = int(name.split(".")[1])
        if index < len(_LEGACY_FC_NORMS):
            forms.append(_LEGACY_FC_NORMS[index] + name[len(f"fc_norm.{index}") :])
    return [*forms, *("model." + f for f in forms)]


def eagle3_params(
    config: Eagle3Config, target: ModelConfig, target_params: Any, directory: str | Path
) -> dict[str, Any]:
    """The draft's weights from the checkpoint in ``directory`` (shapes checked before any data is
    read), with the target's embedding (and its head when the draft has none). ``ConfigError``
    naming ``speculative_draft_model_path`` for a missing tensor, naming the tensor for a shape
    that does not fit or a ``d2t`` outside the target's vocabulary."""
    from kvjax.serve.checkpoint import SafetensorsTensors, flatten_params, set_param

    path = Path(directory)
    shapes = dict(flatten_params(eagle3_param_shapes(config)))
    params: dict[str, Any] = {}
    with SafetensorsTensors(path) as tensors:
        found: dict[tuple[str, ...], str] = {}
        for param_path, name in eagle3_tensor_names(config).items():
            stored = next((n for n in _candidates(name) if n in tensors), None)
            if stored is None:
                raise _refuse(
                    path,
                    f"has no tensor {name!r} (nor {_candidates(name)[1:]}): an {EAGLE3_ARCHITECTURE} checkpoint "
                    "keeps fc.*, midlayer.*, norm.*, lm_head.* and d2t",
                )
            want = tuple(shapes[param_path].shape)
            if tensors.shape(stored) != want:
                raise ConfigError(
                    "tensor", stored, f"has shape {tensors.shape(stored)} in {path} but the EAGLE3 draft needs {want}"
                )
            found[param_path] = stored
        dt = jnp.dtype(config.layer.dtype)
        for param_path, stored in found.items():
            value = tensors.get(stored)
            if param_path == ("d2t",):
                ids = np.arange(value.shape[0]) + value.astype(np.int64)
                if ids.min() < 0 or ids.max() >= target.vocab_size:
                    raise ConfigError(
                        "tensor",
                        stored,
                        f"maps draft ids to {int(ids.min())}..{int(ids.max())} in {path}, outside the target's "
                        f"vocabulary 0..{target.vocab_size - 1}",
                    )
                set_param(params, param_path, jnp.asarray(value, dtype=jnp.int32))
            else:
                set_param(params, param_path, jnp.asarray(value, dtype=dt))
    params["embed_tokens"] = target_params["model"]["embed_tokens"]
    if not config.own_head and not target.tie_word_embeddings:
        params["lm_head"] = target_params["lm_head"]
    return params


def check_eagle3_fits(config: Eagle3Config, draft_params: Any) -> None:
    """``ConfigError`` naming ``speculative_draft_model_path`` when ``draft_params`` are not the
    shapes ``config`` needs (the target's vocabulary or hidden size, read off its shapes)."""
    from kvjax.serve.checkpoint import flatten_params

    shapes = {p: tuple(v.shape) for p, v in flatten_params(draft_params)}
    for path, want in flatten_params(eagle3_param_shapes(config)):
        if shapes.get(path) != tuple(want.shape):
            raise ConfigError(
                "speculative_draft_model_path",
                "/".join(path),
                f"the EAGLE3 draft's weight has shape {shapes.get(path)}, its config needs {tuple(want.shape)} "
                f"(target vocab {config.embed_vocab_size}, hidden {config.layer.hidden_size}): load it with "
                "load_eagle3_draft for this target",
            )


def load_eagle3_draft(directory: str | Path, target: Any) -> NextNDraftModel:
    """The EAGLE3 draft in ``directory`` for ``target`` (a ``LoadedModel``), with the target's
    embedding: a ``NextNDraftModel`` of algorithm ``EAGLE3`` whose ``eagle3`` is its config.
    ``ConfigError`` naming ``speculative_draft_model_path`` for a directory that is not an
    ``LlamaForCausalLMEagle3`` checkpoint or a draft that does not fit (module docstring)."""
    from kvjax.serve.checkpoint import read_config

    path = Path(directory)
    if not (path / "config.json").is_file() or not is_eagle3_draft(path):
        raise _refuse(
            directory,
            f"EAGLE3 reads its draft from a checkpoint directory whose config.json names {EAGLE3_ARCHITECTURE} "
            "(fc.*, midlayer.*, norm.*, lm_head.*, d2t in safetensors)",
        )
    _, raw = read_config(path, servable=False)
    config = eagle3_config(target.config, raw, dict(target.spec.extra), path)
    params = eagle3_params(config, target.config, target.params, path)
    check_eagle3_fits(config, params)
    return NextNDraftModel(
        name=f"{path.name} (EAGLE3 draft)", params=params, path=path, algorithm="EAGLE3", eagle3=config
    )
