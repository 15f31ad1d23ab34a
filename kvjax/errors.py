"""The exceptions kvjax raises on bad input, exhausted memory and missing features.

Every error message names the offending value and what to do about it. A call that raises
one of these leaves the object it was called on unchanged.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration (``CacheConfig``, ``ModelSpec`` or a combination) that cannot be built.

    The message names the option, the value, and the change that fixes it.
    """

    def __init__(self, option: str, value: object, fix: str) -> None:
        self.option = option
        self.value = value
        self.fix = fix
        super().__init__(f"{option}={value!r}: {fix}")


class InvalidSlotError(ValueError):
    """Slot, page or request ids out of range, reserved (slot/page 0) or otherwise unusable."""


class DoubleFreeError(InvalidSlotError):
    """Ids freed that are already free (or freed twice in one call)."""


class OutOfMemoryError(RuntimeError):
    """Not enough free slots, pages or request rows for an allocation that cannot return ``None``."""
