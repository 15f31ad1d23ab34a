"""``python -m kvjax replay``: a request trace through kvjax's radix tree and page allocator,
host-only, with the offline optimum beside the online eviction policies.

    python -m kvjax replay --trace conversation_trace.jsonl --capacity-fraction 0.3 --eviction-policy all --optimum

Capacities are per DP rank, in tokens: ``--capacity-tokens N``, or ``--capacity-fraction F`` of
the trace's distinct prompt content (its distinct blocks times the block size; 1.0 holds every
prompt the trace has). Reports the token hit rate, hit rate by position in session, evictions,
host-tier hits and peak device use per policy, as tables or ``--json``; a progress bar on stderr
when it is a terminal (not with ``--quiet`` or ``--json``). Jax is never imported. Every bad
input is one ``error:`` line naming the flag (or the trace's file and line), exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvjax.cli.arg_types import non_negative_int, positive_float, positive_int
from kvjax.cli.messages import UsageError, config_error_line
from kvjax.errors import ConfigError

__all__ = ["OPTION_FLAGS", "add_parser", "cli_message", "option_flags", "run"]

# ReplayConfig and reader options -> this command's flags (error messages name these).
OPTION_FLAGS = {
    "trace": "--trace",
    "trace_format": "--format",
    "capacity_tokens": "--capacity-tokens",
    "page_size": "--page-size",
    "eviction_policy": "--eviction-policy",
    "host_capacity_tokens": "--host-capacity-tokens",
    "dp_size": "--dp-size",
    "dp_routing": "--dp-routing",
    "dp_load_window_ms": "--dp-load-window-ms",
    "dp_max_load_gap_tokens": "--dp-max-load-gap-tokens",
}


def option_flags(args: argparse.Namespace) -> dict[str, str]:
    """Which flag of ``replay`` sets which option."""
    return OPTION_FLAGS


def cli_message(error: ConfigError, args: argparse.Namespace) -> str:
    """A `ConfigError` in flag words; a bad trace names the file (its fix names the line)."""
    if error.option == "trace":
        return f"--trace {error.value}: {error.render_fix(OPTION_FLAGS)}"
    return config_error_line(error, OPTION_FLAGS, args)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``replay`` sub-command."""
    from kvjax.replay.formats import TRACE_FORMATS
    from kvjax.replay.replay_config import DEFAULT_LOAD_GAP_TOKENS, DEFAULT_LOAD_WINDOW_MS, POLICIES
    from kvjax.serve.dp_router import ROUTING_POLICIES

    p = sub.add_parser(
        "replay",
        help="replay a request trace through the radix tree (no device), against the offline optimum",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", required=True, metavar="FILE", help="the trace (JSON lines)")
    p.add_argument("--format", default="mooncake", choices=sorted(TRACE_FORMATS), help="the trace's format")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--capacity-tokens", type=positive_int, metavar="N", help="device KV tokens per rank")
    size.add_argument(
        "--capacity-fraction",
        type=positive_float,
        metavar="F",
        help="device KV per rank as a share of the trace's distinct prompt tokens (default 0.3)",
    )
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (default 16)")
    p.add_argument(
        "--eviction-policy",
        default="lru",
        metavar="POLICY[,POLICY...]",
        help=f"one or more of {', '.join(POLICIES)}, comma separated, or 'all' (default lru)",
    )
    p.add_argument("--optimum", action="store_true", help="also replay the offline optimum; report each policy's gap")
    p.add_argument(
        "--host-capacity-tokens", type=non_negative_int, default=0, help="host tier tokens per rank (0: off)"
    )
    p.add_argument("--dp-size", type=positive_int, default=1, help="DP ranks, each with its own cache (default 1)")
    p.add_argument("--dp-routing", choices=ROUTING_POLICIES, default="cache_aware", help="how requests pick a rank")
    p.add_argument(
        "--dp-load-window-ms",
        type=positive_float,
        default=DEFAULT_LOAD_WINDOW_MS,
        help=f"how long a request counts in its rank's load (default {DEFAULT_LOAD_WINDOW_MS:g} ms)",
    )
    p.add_argument(
        "--dp-max-load-gap-tokens",
        type=non_negative_int,
        default=DEFAULT_LOAD_GAP_TOKENS,
        help=f"cache-aware routing's overload margin (default {DEFAULT_LOAD_GAP_TOKENS})",
    )
    p.add_argument("--limit", type=positive_int, metavar="N", help="replay the first N requests only")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _policies(text: str) -> list[str]:
    from kvjax.replay.belady import OPTIMUM
    from kvjax.replay.replay_config import POLICIES

    if text.strip().lower() == "all":
        return [p for p in POLICIES if p != OPTIMUM]
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if not names or unknown:
        raise UsageError(
            f"--eviction-policy {text}: {'no policy' if not names else 'unknown ' + ', '.join(unknown)}; "
            f"use one or more of {', '.join(POLICIES)} (comma separated) or all"
        )
    return list(dict.fromkeys(names))


class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._bar: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import Progress

            self._bar = Progress(console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("replay", total=total)

    def advance(self) -> None:
        self._bar.advance(self._task)

    @property
    def callback(self) -> Any:
        return self.advance if self._bar is not None else None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def run(args: argparse.Namespace) -> int:
    from kvjax.replay.formats import read_trace
    from kvjax.replay.replay_config import ReplayConfig
    from kvjax.replay.report import replay_policies

    policies = _policies(args.eviction_policy)
    if args.optimum and (args.dp_size > 1 or args.host_capacity_tokens):
        what = "--dp-size" if args.dp_size > 1 else "--host-capacity-tokens"
        raise UsageError(f"--optimum: the offline optimum is defined for one device cache; drop {what}")
    trace = read_trace(args.trace, args.format, args.limit)
    if not len(trace):
        raise UsageError(f"--trace {args.trace}: holds no requests")
    capacity = args.capacity_tokens
    if capacity is None:
        share = 0.3 if args.capacity_fraction is None else args.capacity_fraction
        capacity = max(int(share * trace.distinct_blocks() * trace.block_size), args.page_size)
    config = ReplayConfig(
        capacity_tokens=capacity,
        page_size=args.page_size,
        eviction_policy=policies[0],
        host_capacity_tokens=args.host_capacity_tokens,
        dp_size=args.dp_size,
        dp_routing=args.dp_routing,
        dp_load_window_ms=args.dp_load_window_ms,
        dp_max_load_gap_tokens=args.dp_max_load_gap_tokens,
    )
    runs = len(policies) + (args.optimum and "belady" not in policies)
    progress = _Progress(not (args.quiet or args.json) and sys.stderr.isatty(), runs * len(trace))
    try:
        report = replay_policies(
            trace, config, policies, optimum=args.optimum, trace_format=args.format, on_request=progress.callback
        )
    finally:
        progress.close()
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    from rich.console import Console

    from kvjax.replay.table import report_tables

    console = Console(width=None if sys.stdout.isatty() else 160)  # a pipe or a file gets whole rows
    for table in report_tables(report):
        console.print(table)
    return 0
