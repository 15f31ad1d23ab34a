"""A `ReplayReport` as rich tables: one row per policy, then hit rate by session position."""

from __future__ import annotations

from typing import Any

from kvjax.replay.report import ReplayReport

__all__ = ["report_tables"]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def report_tables(report: ReplayReport) -> list[Any]:
    """``[summary, by_position]`` ``rich.table.Table`` objects for ``report`` (print them with a
    ``rich.console.Console``)."""
    from rich.table import Table

    rows = list(report.results) + ([report.optimum] if report.optimum is not None else [])
    first = rows[0]
    t = report.trace
    title = f"{t['requests']:,} requests of {t['source']}: "
    title += f"capacity {first.capacity_tokens:,} tokens, page {first.page_size}"
    if first.host_capacity_tokens:
        title += f", host tier {first.host_capacity_tokens:,}"
    if first.dp_size > 1:
        title += f", {first.dp_size} DP ranks ({first.dp_routing})"
    summary = Table(title=title)
    for name in ("policy", "hit rate", "host hits", "gap to optimum", "evicted tokens", "evicted nodes", "peak use"):
        summary.add_column(name, justify="left" if name == "policy" else "right")
    summary.add_column("too large", justify="right")
    summary.add_column("req/s", justify="right")
    for r in rows:
        gap = report.gap(r)
        is_optimum = r is report.optimum
        summary.add_row(
            f"{r.policy} (optimum)" if is_optimum else r.policy,
            _pct(r.token_hit_rate),
            _pct(r.host_hit_rate) if r.host_capacity_tokens else "-",
            "-" if gap is None or is_optimum else f"{100 * gap:+.1f} pts",
            f"{r.evicted_tokens:,}",
            f"{r.evicted_nodes:,}",
            f"{r.peak_device_tokens:,}",
            f"{r.too_large:,}",
            f"{r.requests_per_second:,.0f}",
        )
    buckets = list(first.by_position)
    by_position = Table(title="token hit rate by position in session (requests)")
    by_position.add_column("policy")
    for b in buckets:
        by_position.add_column(f"{b} ({first.by_position[b].requests:,})", justify="right")
    for r in rows:
        by_position.add_row(r.policy, *(_pct(r.by_position[b].hit_rate) for b in buckets))
    return [summary, by_position]
