"""Trace replay benchmark: prints one JSON object.

    python benchmarks/replay.py [--trace FILE] [--limit N] [--hit-rate-page-size 512]

The Mooncake FAST'25 conversation trace (default: ``../shared/data/traces/
mooncake_conversation_trace.jsonl`` from the repository root; skipped with a message when absent)
through ``kvjax.replay`` (kvjax's radix tree, page allocator and request table, host-only):

* ``speed``: replay speed in requests per second (LRU, a device of 30% of the trace's distinct
  blocks) at page sizes 16 and 512, the loop alone (the trace is read before the clock starts);
* ``hit_rates``: token hit rate of every eviction policy and of the offline optimum (leaf-
  constrained Belady) at devices of 10%, 30% and 100% of the trace's distinct blocks (in tokens),
  at ``--hit-rate-page-size``, with each policy's gap to the optimum (hit-rate points).

A few minutes on the full trace (12,031 requests); ``--limit`` cuts it. CPU figures on a shared
machine: compare the policies within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402

from kvjax.replay import OPTIMUM, POLICIES, ReplayConfig, read_trace, replay_policies, replay_trace  # noqa: E402
from kvjax.replay.report import trace_summary  # noqa: E402

DEFAULT_TRACE = _ROOT.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
SHARES = (0.1, 0.3, 1.0)
SPEED_PAGE_SIZES = (16, 512)
SPEED_SHARE = 0.3


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="a Mooncake-format trace")
    ap.add_argument("--limit", type=int, default=None, help="replay the first N requests only")
    ap.add_argument("--hit-rate-page-size", type=int, default=512, help="page size of the hit-rate table")
    args = ap.parse_args(argv)
    if not args.trace.exists():
        out: dict[str, Any] = {"benchmark": "replay", "skipped": f"no trace at {args.trace}; pass --trace FILE"}
        print(json.dumps(out, indent=2))
        return out
    trace = read_trace(args.trace, "mooncake", args.limit)
    blocks_tokens = trace.distinct_blocks() * trace.block_size
    out = {
        "benchmark": "replay",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
        "trace": {**trace_summary(trace, "mooncake"), "source": args.trace.name},
        "speed": {},
        "hit_rates": {"page_size": args.hit_rate_page_size, "capacities": {}},
    }
    for page in SPEED_PAGE_SIZES:
        config = ReplayConfig(capacity_tokens=int(SPEED_SHARE * blocks_tokens), page_size=page)
        result = replay_trace(trace, config)
        out["speed"][f"page_{page}"] = {
            "capacity_tokens": result.capacity_tokens,
            "requests_per_second": round(result.requests_per_second, 1),
            "seconds": round(result.seconds, 2),
            "token_hit_rate": round(result.token_hit_rate, 4),
        }
    online = [p for p in POLICIES if p != OPTIMUM]
    for share in SHARES:
        config = ReplayConfig(capacity_tokens=int(share * blocks_tokens), page_size=args.hit_rate_page_size)
        report = replay_policies(trace, config, online, optimum=True)
        assert report.optimum is not None
        out["hit_rates"]["capacities"][f"{round(share * 100)}%"] = {
            "capacity_tokens": report.optimum.capacity_tokens,
            "token_hit_rate": {r.policy: round(r.token_hit_rate, 4) for r in report.results}
            | {OPTIMUM: round(report.optimum.token_hit_rate, 4)},
            "gap_to_optimum_points": {r.policy: round(100 * (report.gap(r) or 0.0), 2) for r in report.results},
            "evicted_tokens": {r.policy: r.evicted_tokens for r in report.results}
            | {OPTIMUM: report.optimum.evicted_tokens},
            "optimum_hit_rate_by_position": {k: round(v.hit_rate, 4) for k, v in report.optimum.by_position.items()},
            "lru_hit_rate_by_position": {
                k: round(v.hit_rate, 4)
                for k, v in next(r for r in report.results if r.policy == "lru").by_position.items()
            },
        }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
