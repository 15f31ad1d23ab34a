"""Load a Hugging Face checkpoint directory into the serving model (and write one, for tests).

A checkpoint directory holds ``config.json`` and its weights as ``*.safetensors`` files: one
``model.safetensors``, or shards listed by ``model.safetensors.index.json`` (its ``weight_map``
names the file of every tensor). Optional: ``tokenizer.json`` (prompts as text) and
``generation_config.json`` (end-of-sequence ids).

Loading is checked before anything is built: the family must be servable, and every tensor the
model expects (``kvjax.serve.model.param_shapes``) must be present with its exact shape. Tensor
names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``); the parameter path is the
name split at dots, with a list item ``name.N`` (``layers.N``, ``experts.N``) as ``name_N``, after
the family's ``checkpoint_prefix`` (LLaVA's language model: ``language_model.``; its vision side
is read by ``kvjax.serve.image_encoder``, and its tensors are hashed into the fingerprint too: the
image positions' KV depends on them).
Tensors the model does not use (e.g. old ``rotary_emb.inv_freq`` buffers, or ``lm_head.weight``
when the head is tied) are ignored.

Tensors are read with ``safetensors``' numpy API (no torch), hashed into the model's fingerprint
(``kvjax.serve.model_fingerprint``) as read, and cast to the checkpoint's dtype or the ``dtype``
override. Every problem is a `ConfigError` naming what is wrong and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy API needs)
import numpy as np

from kvjax.errors import ConfigError
from kvjax.serve.families import family
from kvjax.serve.model import Params, param_shapes
from kvjax.serve.model_config import DTYPES, ModelConfig, model_config_from_spec
from kvjax.serve.model_fingerprint import WeightsHasher
from kvjax.spec import ModelSpec

INDEX_FILE = "model.safetensors.index.json"
_LIST_ITEM = re.compile(r"^(.+)_(\d+)$")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: its cache spec, serving config, weights, and optional extras.

    ``spec.dtype`` is the serving dtype (the KV pool's); ``fingerprint`` is the digest of the
    config and weights (``kvjax.serve.model_fingerprint``), what the storage tier keys pages by
    (``""``: unknown, which the storage tier refuses); ``stop_token_ids`` are the config's (and
    ``generation_config.json``'s) end-of-sequence ids; ``tokenizer_file`` is ``tokenizer.json``
    when the directory has one.
    """

    name: str
    spec: ModelSpec
    config: ModelConfig
    params: Params
    fingerprint: str = ""
    stop_token_ids: tuple[int, ...] = ()
    tokenizer_file: Path | None = None


def param_name(path: tuple[str, ...]) -> str:
    """A parameter path as the checkpoint's tensor name: flax names the ``i``-th module of a list
    attribute ``name_i`` where the checkpoint says ``name.i`` (``layers_3`` -> ``layers.3``,
    ``experts_7`` -> ``experts.7``)."""
    return ".".join(_LIST_ITEM.sub(r"\1.\2", p) for p in path)


def flatten_params(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``(path, leaf)`` for every leaf of a nested mapping of parameters (or their shapes), depth first."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flatten_params(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def set_param(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in the nested dict ``tree``, making the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def read_config(directory: str | Path, *, servable: bool = True) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory and its parsed ``config.json``; `ConfigError` if either is unusable
    (with ``servable``, also when kvjax does not serve its ``model_type``)."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError("model", str(directory), "not a directory; pass a checkpoint directory or a preset name")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            "model",
            str(directory),
            "has no config.json; pass a Hugging Face checkpoint directory (config.json + weights)",
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("model", str(config_file), f"is not readable JSON ({e}); re-download config.json") from None
    if not isinstance(config, dict):
        raise ConfigError("model", str(config_file), "must hold a JSON object; re-download config.json")
    if servable:
        family(config.get("model_type"))  # a ConfigError naming the servable families
    return path, config


def _safe_open() -> Any:
    """``safetensors.safe_open``, or a `ConfigError` saying how to install it."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError(
            "model", "safetensors", "reading checkpoints needs the safetensors package: pip install safetensors"
        ) from None
    return safe_open


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the shard index or by opening every ``*.safetensors``."""
    safe_open = _safe_open()
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError("model", str(index), f"is not a valid shard index ({e}); re-download it") from None
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ConfigError("model", str(file), f"is listed in {INDEX_FILE} but missing; download every shard")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {other[:3]}: convert them to safetensors)" if other else ""
        raise ConfigError(
            "model", str(path), f"has no *.safetensors weights{hint}; save with save_pretrained or download them"
        )
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="np") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                files[name] = shard
    return files


def _stop_token_ids(path: Path | None, config: Mapping[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [config]
    gen = None if path is None else path / "generation_config.json"
    if gen is not None and gen.is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError):  # an unreadable one adds nothing
            sources.append(json.loads(gen.read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)


class TensorSource(Protocol):
    """Where a checkpoint's tensors come from, by Hugging Face name: safetensors files
    (`SafetensorsTensors`) or a GGUF file (``kvjax.gguf.tensors.GGUFTensors``). ``shape`` reads no
    data; ``get`` returns the tensor as stored (or, for GGUF, dequantised to float32)."""

    def __contains__(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> np.ndarray: ...


class SafetensorsTensors:
    """The tensors of a directory's ``*.safetensors`` files (``_weight_files``), each file opened
    once while the source is used as a context manager."""

    def __init__(self, path: Path) -> None:
        self.files = _weight_files(path)
        self._safe_open = _safe_open()
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> SafetensorsTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._open.clear()

    def _file(self, name: str) -> Any:
        file = self.files[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(self._safe_open(str(file), framework="np"))
        return self._open[file]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get_tensor(name)


def load_checkpoint(directory: str | Path, *, dtype: str | None = None) -> LoadedModel:
    """Read ``directory`` (see the module docstring) into a `LoadedModel`; a GGUF file, or a
    directory holding one, is read through ``kvjax.gguf`` (`load_gguf`).

    ``dtype``: serve in this dtype (``float32``, ``bfloat16``, ``float16``) instead of the
    checkpoint's. Raises `ConfigError` (nothing is kept) for a missing ``config.json`` or weights,
    a family kvjax cannot serve, and a missing or mis-shaped tensor.
    """
    from kvjax.gguf.locate import gguf_path

    gguf = gguf_path(directory)
    if gguf is not None:
        return load_gguf(gguf, dtype=dtype)
    path, raw = read_config(directory)
    with SafetensorsTensors(path) as tensors:
        model = _load(raw, path.name, tensors, where=str(path), config_name="config.json", dtype=dtype)
    tokenizer = path / "tokenizer.json"
    return dataclasses.replace(
        model,
        stop_token_ids=_stop_token_ids(path, raw),
        tokenizer_file=tokenizer if tokenizer.is_file() else None,
    )


def load_gguf(file: str | Path, *, dtype: str | None = None) -> LoadedModel:
    """Read a GGUF file (``kvjax.gguf``: config from its metadata, tensors dequantised to float32)
    into a `LoadedModel`, served in float32 unless ``dtype`` says otherwise. `ConfigError` as
    `load_checkpoint`, and for an architecture, tensor type or tensor name kvjax does not read."""
    from kvjax.gguf.config import hf_config
    from kvjax.gguf.locate import model_name
    from kvjax.gguf.reader import read_gguf
    from kvjax.gguf.tensors import GGUFTensors

    parsed = read_gguf(file)
    raw = hf_config(parsed)
    family(raw["model_type"])
    tensors = GGUFTensors(parsed, heads=raw["num_attention_heads"], kv_heads=raw["num_key_value_heads"])
    model = _load(raw, model_name(parsed.path), tensors, where=str(file), config_name="its metadata", dtype=dtype)
    return dataclasses.replace(model, stop_token_ids=_stop_token_ids(None, raw))


def _load(
    raw: dict[str, Any], name: str, tensors: TensorSource, *, where: str, config_name: str, dtype: str | None
) -> LoadedModel:
    """The model of config ``raw`` with every expected tensor from ``tensors``: all names and
    shapes are checked before any data is read."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"use one of {list(DTYPES)}")
    spec = ModelSpec.from_hf_config(raw, name=name)
    if dtype is not None:
        spec = dataclasses.replace(spec, dtype=dtype)
    config = model_config_from_spec(spec)
    expected = dict(flatten_params(param_shapes(config)))
    prefix = family(spec.model_type).checkpoint_prefix  # LLaVA: the language model's tensors
    for param_path, want in expected.items():
        tensor_name = prefix + param_name(param_path)
        if tensor_name not in tensors:
            raise ConfigError(
                "tensor",
                tensor_name,
                f"missing from {where} (expected shape {tuple(want.shape)}); the weights do not match {config_name}",
            )
        got, shape = tensors.shape(tensor_name), tuple(want.shape)
        if got != shape:
            raise ConfigError(
                "tensor",
                tensor_name,
                f"has shape {got} in {where} but {config_name} implies {shape}; the weights do not match {config_name}",
            )
    target = jnp.dtype(config.dtype)
    params: dict[str, Any] = {}
    fingerprint = WeightsHasher(raw, config.dtype)
    for param_path in expected:
        tensor_name = prefix + param_name(param_path)
        tensor = tensors.get(tensor_name)
        fingerprint.add(tensor_name, tensor)
        set_param(params, param_path, jnp.asarray(tensor, dtype=target))
    if prefix:  # a vision-language model: its vision weights decide the image positions' KV too
        for name in sorted(getattr(tensors, "files", ())):
            if not name.startswith(prefix):
                fingerprint.add(name, tensors.get(name))
    return LoadedModel(name=name, spec=spec, config=config, params=params, fingerprint=fingerprint.hexdigest())


def save_checkpoint(directory: str | Path, spec: ModelSpec, params: Params) -> Path:
    """Write ``spec``'s ``config.json`` and ``params`` as ``model.safetensors`` (numpy API) into
    ``directory`` (created). The inverse of `load_checkpoint`; used by tests and benchmarks."""
    from safetensors.numpy import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(spec.extra)
    config.setdefault("torch_dtype", spec.dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {param_name(p): np.asarray(jax.device_get(v)) for p, v in flatten_params(params)}
    save_file(tensors, str(path / "model.safetensors"))
    return path
