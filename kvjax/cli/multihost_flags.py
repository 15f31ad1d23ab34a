"""The command-line flags of a multi-process run (``demo``, ``generate``), and the group they join.

``--num-processes N --process-id I --coordinator HOST:PORT`` (what ``python -m kvjax launch``
passes each process it starts), or ``--distributed`` alone on a TPU pod, where JAX detects all
three itself. ``--process-timeout`` bounds every wait (seconds). Whether every step's state
digests are compared is the environment's ``KVJAX_CHECK_AGREEMENT=1``, read here (the command
line) only and passed down. The group's secret is never a flag (a command line is visible to
every user of the host): ``KVJAX_CLUSTER_SECRET`` in the environment, which ``launch`` sets and
``kvjax.multihost.process_group.initialize`` reads (``kvjax.multihost.cluster_secret``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvjax.cli.arg_types import non_negative_int, positive_float, positive_int

__all__ = ["CHECK_AGREEMENT_ENV", "add_process_arguments", "join_group", "joins_group", "process_flags"]

#: Set to 1 to compare every process's state digest at every step (a divergence stops the run).
CHECK_AGREEMENT_ENV = "KVJAX_CHECK_AGREEMENT"


def add_process_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of a multi-process run to ``parser``."""
    group = parser.add_argument_group("several processes (jax.distributed; python -m kvjax launch sets these)")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="join a jax.distributed run (JAX detects the "
        "coordinator, process count and id on a TPU pod; the flags below set them elsewhere)",
    )
    group.add_argument("--num-processes", type=positive_int, default=None, help="processes in the run")
    group.add_argument("--process-id", type=non_negative_int, default=None, help="this process's id (0: coordinator)")
    group.add_argument("--coordinator", metavar="HOST:PORT", default=None, help="process 0's coordination service")
    group.add_argument("--local-cpu-devices", type=positive_int, default=None, help="CPU devices of this process")
    group.add_argument("--process-timeout", type=positive_float, default=60.0, help="bound of every wait, seconds (60)")


def joins_group(args: argparse.Namespace) -> bool:
    """Whether the flags ask to join a multi-process run (checked without jax)."""
    given = (args.num_processes, args.process_id, args.coordinator)
    return bool(args.distributed) or any(v is not None for v in given)


def process_flags(args: argparse.Namespace) -> Any:
    """The `ProcessFlags` the flags ask for, or None for a single-process run."""
    from kvjax.multihost.process_group import ProcessFlags

    if not joins_group(args):
        return None
    return ProcessFlags(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        cpu_devices=args.local_cpu_devices,
        timeout_s=args.process_timeout,
        check_agreement=os.environ.get(CHECK_AGREEMENT_ENV, "") not in ("", "0"),
    )


def join_group(args: argparse.Namespace) -> Any:
    """Join the run the flags ask for (``kvjax.multihost.process_group.initialize``); the
    `ProcessGroup`, or None for a single-process run."""
    flags = process_flags(args)
    if flags is None:
        return None
    from kvjax.multihost.process_group import initialize

    return initialize(flags)
