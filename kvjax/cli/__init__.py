"""The command line: ``python -m kvjax plan|demo|generate|launch|replay``.

Each sub-command is one module with ``add_parser(subparsers)``, ``option_flags(args)`` (which
flag sets which ``CacheConfig`` option, for error messages) and ``run(args) -> exit code``. Only
the module of the command being run is imported (the others register a one-line stub). Every
argument is checked before jax is imported or a model is built: argparse types for numbers and
sizes, then each command's own checks (the plan, which is jax-free, included).

Errors speak command line: one ``error:`` line on stderr naming the flag, its value and the fix,
exit status 2, no traceback. A closed pipe (``plan ... | head -1``) ends quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from kvjax.cli.arg_types import parse_bytes
from kvjax.cli.messages import UsageError, config_error_line
from kvjax.errors import ConfigError, InvalidSlotError, OutOfMemoryError

# name -> the command's module, or its dotted path (imported only when that command runs).
COMMANDS: dict[str, ModuleType | str] = {
    "plan": "kvjax.cli.plan_command",
    "demo": "kvjax.cli.demo_command",
    "generate": "kvjax.cli.generate_command",
    "launch": "kvjax.cli.launch_command",
    "replay": "kvjax.cli.replay_command",
}
_SUMMARIES = {
    "plan": "plan a KV cache: tokens that fit, per-pool bytes, decisions",
    "demo": "serve a reuse-heavy workload with the tiny model, cold and warm",
    "generate": "greedy generation with a model directory or preset",
    "launch": "run a command as N local processes of one jax.distributed run",
    "replay": "replay a request trace through the radix tree (no device), against the offline optimum",
}
# What `python -m kvjax --help` says: for users, not about this module.
_DESCRIPTION = """\
kvjax: SGLang's KV-cache subsystem in JAX. Plan a KV cache, serve a workload through it, or
generate with a checkpoint.

examples:
  python -m kvjax plan --model llama-3-8b --memory 16GiB
  python -m kvjax demo --max-total-tokens 512
  python -m kvjax generate --model tiny --prompt-ids 1,2,3 --max-new-tokens 8

Run python -m kvjax COMMAND --help for a command's flags. A bad argument stops with one line
naming the flag, its value and the fix (exit status 2).
"""
# Set to print the traceback of an unexpected error (a bug) instead of its one-line summary.
TRACEBACK_ENV = "KVJAX_TRACEBACK"

__all__ = ["COMMANDS", "TRACEBACK_ENV", "main", "parse_bytes"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``prog: error: message; see --help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _module(name: str) -> ModuleType:
    entry = COMMANDS[name]
    return importlib.import_module(entry) if isinstance(entry, str) else entry


def _parser(command: str | None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m kvjax", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="{" + ",".join(COMMANDS) + "}"
    )
    for name in COMMANDS:
        if name == command:
            _module(name).add_parser(sub)
        else:
            sub.add_parser(name, help=_SUMMARIES.get(name, ""), add_help=False)
    return parser


def _join_negative_values(parser: argparse.ArgumentParser, argv: list[str], command: str | None) -> list[str]:
    """``--memory -1GiB`` -> ``--memory=-1GiB`` (and ``--prompt-ids -1,2``), so a value that starts
    with ``-`` reaches its flag's own check instead of argparse reading it as an unknown option."""
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
        takes_value = found is not None and found.nargs is None  # switches have nargs=0
        if takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] not in actions:
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code: 0, 1 when a run's own checks failed (the demo's
    leak check), 2 for a usage or configuration error, 3 for an unexpected error (a bug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    command = command if command in COMMANDS else None
    parser = _parser(command)
    args = parser.parse_args(_join_negative_values(parser, argv, command))
    module = _module(args.command)
    prefix = f"{parser.prog} {args.command}: error:"
    try:
        code = module.run(args)
        sys.stdout.flush()
        return int(code)
    except BrokenPipeError:
        # The reader went away (``| head -1``): stop quietly, and keep Python's exit-time flush quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except UsageError as e:
        return _fail(f"{prefix} {e}", 2)
    except ConfigError as e:
        line = module.cli_message(e, args) if hasattr(module, "cli_message") else None
        return _fail(f"{prefix} {line or config_error_line(e, module.option_flags(args), args)}", 2)
    except (OutOfMemoryError, InvalidSlotError) as e:
        return _fail(f"{prefix} {e}", 2)
    except NotImplementedError as e:
        return _fail(f"{prefix} not built in kvjax yet: {e}", 2)
    except FileNotFoundError as e:
        return _fail(f"{prefix} {e.filename}: no such file", 2)
    except Exception as e:  # noqa: BLE001  a bug: one line, the traceback on request
        if os.environ.get(TRACEBACK_ENV):
            traceback.print_exc()
        summary = str(e).splitlines()[0] if str(e) else ""
        return _fail(
            f"{prefix} unexpected {type(e).__name__}: {summary} (a bug in kvjax; please report it with the "
            f"command line; {TRACEBACK_ENV}=1 prints the traceback)",
            3,
        )


def _fail(line: str, code: int) -> int:
    sys.stdout.flush()
    print(line, file=sys.stderr)
    return code
