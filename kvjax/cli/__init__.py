"""The command line: ``python -m kvjax plan|demo``.

Each sub-command is one module with ``add_parser(subparsers)`` and ``run(args) -> exit code``.
Registering a command imports only its module; heavy imports (jax, the serving model) happen
inside ``run``, so ``python -m kvjax plan`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvjax.cli import demo_command, plan_command
from kvjax.cli.plan_command import parse_bytes
from kvjax.errors import ConfigError

COMMANDS = {"plan": plan_command, "demo": demo_command}

__all__ = ["COMMANDS", "main", "parse_bytes"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for a configuration error)."""
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
