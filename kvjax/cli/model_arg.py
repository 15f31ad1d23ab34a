"""``--model`` of ``demo`` and ``generate``: a checkpoint directory, a GGUF file (or an installed
GGUF model's name, such as ``smollm2``) or a preset, read without jax."""

from __future__ import annotations

from pathlib import Path

from kvjax.cli.messages import UsageError
from kvjax.spec import ModelSpec

_WHAT = "pass a checkpoint directory (config.json and *.safetensors), a .gguf file or a preset such as tiny"


def model_spec(model: str) -> ModelSpec:
    """The `ModelSpec` of ``--model``: a directory's ``config.json``, or a preset. A `UsageError`
    says whether the directory is missing, is a file or has no ``config.json``, before jax is
    imported or a weight is read. A GGUF file's spec comes from its metadata (``kvjax.gguf``)."""
    from kvjax.gguf.locate import gguf_path

    if gguf_path(model) is not None:  # a ConfigError for an uninstalled model package or several files
        return ModelSpec.resolve(model)
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: the directory has no config.json; {_WHAT}")
        return ModelSpec.from_json_file(path / "config.json")
    if model in ModelSpec.presets():
        return ModelSpec.preset(model)
    if path.exists():
        raise UsageError(f"--model {model}: is a file, not a directory; {_WHAT}")
    if len(path.parts) > 1 or model.startswith("."):
        raise UsageError(f"--model {model}: no such directory; {_WHAT}")
    raise UsageError(
        f"--model {model}: no such preset or directory; use a checkpoint directory or one of "
        f"{', '.join(ModelSpec.presets())}"
    )
