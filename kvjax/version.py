"""`__version__`: the package's version (``project.version`` of ``pyproject.toml``).

A core module of its own, importing nothing, so that any layer can read the version (the serving
layer writes it into model fingerprints) without importing the package's ``__init__`` (the
application layer); ``kvjax.__version__`` is this value.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
