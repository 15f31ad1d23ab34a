"""The command line: ``python -m kvjax plan|demo|generate``.

Each sub-command is one module with ``add_parser(subparsers)`` and ``run(args) -> exit code``.
Only the module of the command being run is imported (the others register a one-line stub), and
heavy imports (jax, the serving model) happen inside ``run``, so ``python -m kvjax plan`` stays fast.

Errors speak command line: one ``error:`` line on stderr naming the flag, its value and the fix,
exit status 2, no traceback. A closed pipe (``plan ... | head -1``) ends quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from kvjax.cli.plan_command import UsageError, cli_message, parse_bytes
from kvjax.errors import ConfigError

# name -> the command's module, or its dotted path (imported only when that command runs).
COMMANDS: dict[str, ModuleType | str] = {
    "plan": "kvjax.cli.plan_command",
    "demo": "kvjax.cli.demo_command",
    "generate": "kvjax.cli.generate_command",
}
_SUMMARIES = {
    "plan": "plan a KV cache: tokens that fit, per-pool bytes, decisions",
    "demo": "serve a reuse-heavy workload with the tiny model, cold and warm",
    "generate": "greedy generation with a model directory or preset",
}

__all__ = ["COMMANDS", "main", "parse_bytes"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``prog: error: message; see --help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _module(name: str) -> ModuleType:
    entry = COMMANDS[name]
    return importlib.import_module(entry) if isinstance(entry, str) else entry


def _parser(command: str | None) -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m kvjax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        if name == command:
            _module(name).add_parser(sub)
        else:
            sub.add_parser(name, help=_SUMMARIES.get(name, ""), add_help=False)
    return parser


def _join_negative_values(parser: argparse.ArgumentParser, argv: list[str], command: str | None) -> list[str]:
    """``--memory -1GiB`` -> ``--memory=-1GiB``, so a negative value reaches its flag's own check
    instead of argparse reading it as an unknown option."""
    actions: dict[str, argparse.Action] = {}
    for group_action in parser._subparsers._group_actions if parser._subparsers else ():  # noqa: SLF001
        sub = getattr(group_action, "choices", {}).get(command) if command else None
        if sub is not None:
            actions = {s: a for a in sub._actions for s in a.option_strings}  # noqa: SLF001
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        found = actions.get(token)
        takes_value = found is not None and found.nargs is None and bool(found.option_strings) and found.const is None
        if takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] not in actions:
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for a usage or configuration error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    command = command if command in COMMANDS else None
    parser = _parser(command)
    args = parser.parse_args(_join_negative_values(parser, argv, command))
    try:
        code = _module(args.command).run(args)
        sys.stdout.flush()
        return int(code)
    except BrokenPipeError:
        # The reader went away (``| head -1``): stop quietly, and keep Python's exit-time flush quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except UsageError as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"{parser.prog} {args.command}: error: {cli_message(e, args)}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"{parser.prog} {args.command}: error: {e.filename}: no such file", file=sys.stderr)
        return 2
