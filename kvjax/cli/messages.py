"""Errors in command-line words: one line naming the flag the user typed, its value and the fix.

kvjax names its options as ``CacheConfig`` fields (``tp_size``, ``page_size``) in a
`kvjax.ConfigError`, and refers to other options inside the fix as ``{option}``. Each command
says which of its flags set which option (``option_flags(args)``); `config_error_line` renders
the error with that mapping, so an error speaks of ``--page-size`` under ``plan`` and of the
option's own name where the command has no flag for it, never of a flag the command lacks.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(CacheConfig))


class UsageError(Exception):
    """A command-line mistake: printed as one ``error:`` line, exit status 2."""


def typed_value(args: argparse.Namespace, flag: str) -> object | None:
    """The value ``args`` holds for ``flag`` (``--page-size`` -> ``args.page_size``); None when
    the flag is unset or a switch that is off."""
    value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
    return None if value is None or value is False else value


def config_error_line(
    error: ConfigError,
    flags: Mapping[str, str],
    args: argparse.Namespace,
    *,
    show: Mapping[str, str] | None = None,
) -> str:
    """``error`` as ``FLAG VALUE: fix`` with the command's ``flags`` (option -> flag).

    ``show``: how to print a flag's value where ``str`` of it is not what the user wrote (a size
    in bytes). An option without a flag here keeps its name: ``option=value: fix``, after
    ``--model NAME:`` when it is not a cache setting (a key of the model's config.json).
    """
    fix = error.render_fix(flags)
    flag = flags.get(error.option)
    if flag is None:
        value = "not set" if error.value is None else repr(error.value)
        model = getattr(args, "model", None)
        where = f"--model {model}: " if model is not None and error.option not in _CONFIG_FIELDS else ""
        return f"{where}{error.option}={value}: {fix}"
    typed = typed_value(args, flag)
    if show is not None and flag in show:
        shown = show[flag]
    elif typed is not None and typed is not True:
        shown = str(typed)
    else:
        shown = "" if typed is True else ("not set" if error.value is None else str(error.value))
    return f"{flag} {shown}: {fix}" if shown else f"{flag}: {fix}"
