"""``--model`` of ``demo`` and ``generate``: a checkpoint directory or a preset, read without jax."""

from __future__ import annotations

from pathlib import Path

from kvjax.cli.messages import UsageError
from kvjax.spec import ModelSpec

_WHAT = "pass a checkpoint directory (config.json and *.safetensors) or a preset such as tiny"


def model_spec(model: str) -> ModelSpec:
    """The `ModelSpec` of ``--model``: a directory's ``config.json``, or a preset. A `UsageError`
    says whether the directory is missing, is a file or has no ``config.json``, before jax is
    imported or a weight is read."""
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
