"""Argument types shared by the sub-commands: argparse rejects a bad value with one line naming
the flag, before anything is imported or built."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"1073741824"`` -> bytes (> 0).

    Raises `argparse.ArgumentTypeError` saying what a size looks like; a negative or zero size
    says that sizes are positive.
    """
    m = re.fullmatch(r"\s*([-+]?)([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(3).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write one such as 16GiB, 512MiB or 1073741824")
    value = int(float(m.group(2)) * _UNITS[m.group(3).lower()])
    if m.group(1) == "-" or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive; write one such as 16GiB")
    return value


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number >= 1")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number >= 0")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_float(text: str) -> float:
    """A number > 0 (seconds, milliseconds, a share)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number > 0")
    return value


def fraction(text: str) -> float:
    """A share of a chip's memory, in (0, 1]."""
    value = _number(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction of the chip's memory must be in (0, 1]")
    return value
