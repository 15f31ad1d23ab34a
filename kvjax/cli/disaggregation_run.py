"""``generate`` and ``demo`` as a prefill or a decode server (``--disaggregation-mode``;
``kvjax.cli.disaggregation_flags`` checks the flags before this module is imported).

* prefill: the model and cache built as the command builds them (``generate``: the model's context,
  a pool of ``--max-total-tokens``; ``demo``: the demo's cache), a `PrefillServer` on the
  bootstrap port, one line ``prefill server listening on HOST:PORT`` on standard output, served
  until SIGINT or SIGTERM (exit status 0, a one-line summary on standard error).
* decode: ``generate``'s prompts (``kvjax.disaggregation.serving.decode_generate``), or ``demo``'s
  workload (its cold run served here, colocated, as the reference; its warm run through a
  `DecodeServer`), printed as a colocated run prints them, with the decode server's counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from typing import Any

from kvjax.cli.disaggregation_flags import bind_host, bootstrap_port, failed_requests, timeout_s
from kvjax.cli.messages import UsageError
from kvjax.cli.serving_args import kv_events_options

__all__ = ["demo_disaggregated", "generate_decode", "generate_prefill", "serve_prefill"]


def serve_prefill(command: str, build: Any, port: int, host: str) -> int:
    """Start the prefill server ``build(port)`` returns, print its address line, serve until
    SIGINT or SIGTERM; 0. A group's process 0 prints (and decides when to stop); the others
    follow it."""
    try:
        server = build(port)
    except OSError as e:
        raise UsageError(
            f"--host {host} --disaggregation-bootstrap-port {port}: cannot listen there ({e.strerror or e}); give "
            "another port (0 for a free one), or an interface of this host"
        ) from None
    first = server.process == 0
    if first:
        print(f"prefill server listening on {server.address}", flush=True)
    received: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.serve(stop=lambda: bool(received))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
    name = signal.Signals(received[0]).name if received else "stop"
    if not first:
        return 0
    print(
        f"python -m kvjax {command}: prefill server {server.address} stopped ({name}): {server.prefilled} prompts "
        f"prefilled, {server.offered_tokens} tokens offered",
        file=sys.stderr,
    )
    return 0


def generate_prefill(args: argparse.Namespace, group: Any = None) -> int:
    """``generate --disaggregation-mode prefill`` (``group``: this process's `ProcessGroup` when
    the server is several processes, else None)."""
    from kvjax.disaggregation.serving import prefill_config, prefill_server
    from kvjax.serve.generate import resolve_model

    model = resolve_model(args.model, dtype=args.dtype)
    config = prefill_config(
        model,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        max_batch_size=args.max_batch_size,
        tp_size=args.tp,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
    )
    overlap = not args.disable_overlap_schedule

    def build(port: int) -> Any:
        return prefill_server(
            model,
            config,
            port=port,
            host=bind_host(args),
            max_batch_size=args.max_batch_size,
            overlap=overlap,
            group=group,
        )

    return serve_prefill("generate", build, bootstrap_port(args), bind_host(args))


def generate_decode(args: argparse.Namespace, model: Any, prompts: list[list[int]], common: dict[str, Any]) -> Any:
    """``generate --disaggregation-mode decode``: the `GenerateResult` (with its ``disaggregation``
    counters) of ``prompts`` served through a decode server, ``common`` being ``generate``'s
    keyword arguments."""
    from kvjax.disaggregation.serving import decode_generate

    given = {k: v for k, v in common.items() if k != "vlm_cache_size_mb"}
    with _prefill_servers_reached():
        result, _ = decode_generate(
            model,
            prompts,
            prefill=args.disaggregation_prefill_addr,
            timeout_s=timeout_s(args),
            host=bind_host(args),
            decode_radix_cache=args.disaggregation_decode_enable_radix_cache,
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            enable_hierarchical_cache=args.enable_hierarchical_cache,
            overlap=not args.disable_overlap_schedule,
            tp_size=args.tp,
            **kv_events_options(args),
            **given,
        )
    return result


def demo_disaggregated(args: argparse.Namespace, workload: Any, model: Any, cache: dict[str, Any]) -> int:
    """``demo --disaggregation-mode prefill|decode`` (``cache``: the demo's cache options)."""
    from kvjax.demo_config import DEMO_MODEL
    from kvjax.serve.checkpoint import LoadedModel

    if model is None:  # the demo's own tiny model: its weights and fingerprint as ``kvjax.demo.serve`` draws them
        from kvjax.serve.model import init_params
        from kvjax.serve.model_fingerprint import random_weights_fingerprint
        from kvjax.spec import ModelSpec

        spec = ModelSpec.preset(DEMO_MODEL)
        model = LoadedModel(
            name=DEMO_MODEL,
            spec=spec,
            config=spec,  # type: ignore[arg-type]  # the scheduler serves a spec as a config
            params=init_params(spec, seed=0),
            fingerprint=random_weights_fingerprint(spec, 0),
        )
        served = None
    else:
        served = model
    overlap = not args.disable_overlap_schedule
    if args.disaggregation_mode == "prefill":
        host = bind_host(args)
        build = lambda port: _demo_prefill(model, cache, port, host, overlap)  # noqa: E731
        return serve_prefill("demo", build, bootstrap_port(args), host)
    report, counters = _demo_decode(args, workload, model, served, cache, overlap)
    if args.json:
        print(json.dumps({**report.to_dict(), "disaggregation": counters}))
    else:
        print(report)
        print(disaggregation_line(counters))
    code = 0 if report.ok else 1
    return failed_requests("demo", counters) or code


def _demo_prefill(model: Any, cache: dict[str, Any], port: int, host: str, overlap: bool) -> Any:
    from kvjax.demo import MAX_BATCH, demo_cache
    from kvjax.disaggregation.prefill import PrefillServer
    from kvjax.serve.scheduler import Scheduler

    kv = demo_cache(spec=model.spec, **cache, disaggregation_mode="prefill")
    scheduler = Scheduler(model.config, kv, model.params, max_batch_size=MAX_BATCH, overlap=overlap)
    return PrefillServer(scheduler, fingerprint=model.fingerprint, host=host, port=port)


def _demo_decode(
    args: argparse.Namespace, workload: Any, model: Any, served: Any, cache: dict[str, Any], overlap: bool
) -> tuple[Any, dict[str, Any]]:
    """The demo's report with its warm run served through a decode server (the cold run, radix
    cache off, served here as the reference), and the decode server's counters."""
    import dataclasses
    import time

    from kvjax.demo import MAX_BATCH, DemoReport, _run_fields, _tree_text, demo_cache, serve
    from kvjax.disaggregation.decode import DecodeServer
    from kvjax.disaggregation.serving import disaggregation_counters
    from kvjax.serve.scheduler import Scheduler
    from kvjax.serve.workload import run_workload

    if served is not None:
        workload = dataclasses.replace(workload, vocab_size=min(workload.vocab_size, model.config.vocab_size))
    cold, cold_out = serve(workload, model=served, overlap=overlap, disable_radix_cache=True, **cache)
    if not isinstance(cold, Scheduler):
        raise AssertionError("a disaggregated demo serves one rank: its cold run has one Scheduler")
    radix = args.disaggregation_decode_enable_radix_cache
    kv = demo_cache(
        spec=model.spec, **cache, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=radix
    )
    scheduler = Scheduler(model.config, kv, model.params, max_batch_size=MAX_BATCH, overlap=overlap)
    with _prefill_servers_reached():
        server = DecodeServer(
            scheduler,
            fingerprint=model.fingerprint,
            prefill=args.disaggregation_prefill_addr,
            timeout_s=timeout_s(args),
            host=bind_host(args),
        )
    start = time.perf_counter()
    try:
        warm_out = run_workload(server, workload)
    finally:
        server.close()
    seconds = time.perf_counter() - start
    counters = disaggregation_counters([server])
    counters["failed"] = [{"request": str(r.rid), "reason": r.abort_reason} for r in server.failed]
    stats = scheduler.stats
    prompt_tokens = server.pulled_tokens + server.reused_tokens
    report = DemoReport(
        **_run_fields(server, cold, warm_out, cold_out, seconds, served, None),  # type: ignore[arg-type]
        requests=len(warm_out),
        # as colocated: the prompts' tokens, and those the tree here held (the rest was pulled)
        prompt_tokens=prompt_tokens,
        cached_tokens=server.reused_tokens,
        hit_rate=round(server.reused_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        prefill_tokens_computed=stats.prefill_tokens_computed,
        cold_prefill_tokens_computed=cold.stats.prefill_tokens_computed,
        generated_tokens=stats.generated_tokens,
        tokens_per_second=round(stats.generated_tokens / seconds, 1),
        peak_pool_occupancy=round(max(stats.occupancy, default=0.0), 4),
        pool_tokens=scheduler.alloc.size,
        evicted_tokens=stats.evicted_tokens,
        retractions=stats.retractions,
        tree_text=_tree_text(kv.tree_cache),
    )
    return report, counters


@contextlib.contextmanager
def _prefill_servers_reached() -> Iterator[None]:
    """A prefill server that cannot be reached, fails the handshake or refuses this decode server
    (another model or cache) as one ``error:`` line naming the flag."""
    from kvjax.disaggregation.decode import PDRefused
    from kvjax.disaggregation.link import LinkError

    try:
        yield
    except (LinkError, PDRefused) as e:
        raise UsageError(f"--disaggregation-prefill-addr: {e}") from None


def disaggregation_line(counters: dict[str, Any]) -> str:
    """The decode server's counters as one line of text output."""
    return (
        f"disaggregated: {counters['pulled_tokens']} prompt tokens pulled from {counters['prefill_servers']} "
        f"prefill server(s) in {counters['pulls']} pulls ({counters['transfer_seconds']:.3f} s), "
        f"{counters['reused_tokens']} reused from this server's tree, {counters['failed_requests']} failed requests"
    )
