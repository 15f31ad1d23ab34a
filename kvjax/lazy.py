"""`lazy_getattr`: a package's module ``__getattr__`` (PEP 562) that imports a public name's module on
first access, so that importing the package stays cheap (``import kvjax`` loads no jax)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of package ``package``: name ``n`` of ``modules`` is read from module
    ``modules[n]`` on first access and kept in the package's namespace (later reads are plain
    attribute reads); any other name raises ``AttributeError`` naming the package."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's name
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
