"""The exceptions kvjax raises on bad input, exhausted memory and missing features.

Every error message names the offending value and what to do about it. A call that raises
one of these leaves the object it was called on unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# ``{option_name}`` in a fix: a reference to another option, spelled by whoever renders the error.
_OPTION_REFERENCE = re.compile(r"\{([a-z][a-z0-9_]*)\}")


class ConfigError(ValueError):
    """A configuration (``CacheConfig``, ``ModelSpec`` or a combination) that cannot be built.

    The message names the option, the value, and the change that fixes it. ``fix`` may refer to
    options as ``{option_name}`` (``"use {tp_size} 1, 2 or 4"``): ``str(error)`` spells them as
    the option names, and a front end with names of its own (the command line's flags) renders
    the same fix with `render_fix`.
    """

    def __init__(self, option: str, value: object, fix: str) -> None:
        self.option = option
        self.value = value
        self.fix = fix
        super().__init__(f"{option}={value!r}: {self.render_fix()}")

    def render_fix(self, names: Mapping[str, str] | None = None) -> str:
        """``fix`` with each ``{option}`` reference spelled ``names[option]`` (the option's own
        name where ``names`` has none)."""
        names = names or {}
        return _OPTION_REFERENCE.sub(lambda m: names.get(m.group(1), m.group(1)), self.fix)


class InvalidSlotError(ValueError):
    """Slot, page or request ids out of range, reserved (slot/page 0) or otherwise unusable."""


class DoubleFreeError(InvalidSlotError):
    """Ids freed that are already free (or freed twice in one call)."""


class OutOfMemoryError(RuntimeError):
    """Not enough free slots, pages or request rows for an allocation that cannot return ``None``."""
