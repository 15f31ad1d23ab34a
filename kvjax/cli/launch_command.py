"""``python -m kvjax launch --processes N -- demo ...`` (or ``-- generate ...``): one command as N
local processes of one ``jax.distributed`` run (``kvjax.serve.multihost.launcher``); for trying
multi-process serving on one machine. Each launch gives its processes a fresh cluster secret in their environment
(``KVJAX_CLUSTER_SECRET``), with which they authenticate each other. On a TPU pod every host runs
the command itself with ``--distributed`` and the same exported ``KVJAX_CLUSTER_SECRET``."""

from __future__ import annotations

import argparse

from kvjax.cli.arg_types import positive_int
from kvjax.cli.messages import UsageError

#: The commands that join a multi-process run.
MULTI_PROCESS_COMMANDS = ("demo", "generate")


def option_flags(args: argparse.Namespace) -> dict[str, str]:
    return {}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``launch`` sub-command."""
    p = sub.add_parser("launch", help="run a command as N local processes of one jax.distributed run")
    p.add_argument("--processes", type=positive_int, required=True, help="processes to start")
    p.add_argument(
        "--cpu-devices-per-process", type=positive_int, default=None, help="split each process's CPU into N devices"
    )
    p.add_argument("--port", type=positive_int, default=None, help="the coordinator's loopback port (default: free)")
    p.add_argument(
        "argv",
        metavar="COMMAND",
        nargs=argparse.REMAINDER,
        help="-- then the command, demo or generate: e.g. -- demo --tp 8, or -- generate --model DIR --tp 8 "
        "--prompt TEXT",
    )


def run(args: argparse.Namespace) -> int:
    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or command[0] not in MULTI_PROCESS_COMMANDS:
        given = command[0] if command else "nothing"
        raise UsageError(
            f"launch runs {' or '.join(MULTI_PROCESS_COMMANDS)} across processes, got {given}; "
            "e.g. python -m kvjax launch --processes 2 -- demo --tp 8"
        )
    from kvjax.serve.multihost.launcher import launch

    return launch(command, args.processes, cpu_devices=args.cpu_devices_per_process, port=args.port)
