"""The command line's disaggregated runs: a prefill server built as ``generate`` builds its cache,
and ``generate``'s prompts served through a decode server.

* `prefill_config` / `prefill_server`: the cache of a prefill server (no prompts are known: the
  model's context, a pool of ``max_total_tokens``) and the `PrefillServer` over it, its
  ``CacheConfig.disaggregation_mode`` ``"prefill"``.
* `decode_generate`: ``kvjax.serve.generate.generate``'s workload (the same requests, the same
  cache, each prompt submitted once the one before it holds its KV here, so later prompts reuse
  earlier prefixes) served by a `DecodeServer` whose prompts are computed on the prefill servers
  given; greedy tokens are those of a colocated ``generate``. Returns the result and the server (its
  counters: pulled and reused tokens, failed requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvjax.build import build_kv_cache
from kvjax.config import CacheConfig
from kvjax.disaggregation.decode import DecodeServer
from kvjax.disaggregation.prefill import PrefillServer
from kvjax.multihost.process_group import ProcessGroup
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.generate import (
    GenerateResult,
    StepCallback,
    _checked_prompts,
    _config,
    _events_here,
    _per_prompt,
    _requests,
    _result,
    _serve_with_events,
)
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.tp_mesh import tp_mesh

__all__ = ["PREFILL_POOL_CONTEXTS", "decode_generate", "disaggregation_counters", "prefill_config", "prefill_server"]

#: A prefill server's default pool: room for this many requests of the model's whole context.
PREFILL_POOL_CONTEXTS = 2


def prefill_config(
    model: LoadedModel,
    *,
    page_size: int = 16,
    max_total_tokens: int | None = None,
    chunked_prefill_size: int = 512,
    max_batch_size: int = 16,
    tp_size: int = 1,
    enable_hierarchical_cache: bool = False,
) -> CacheConfig:
    """A prefill server's cache: the model's context, a pool of ``max_total_tokens`` (default:
    `PREFILL_POOL_CONTEXTS` whole contexts, in pages), ``disaggregation_mode="prefill"``."""
    context = model.spec.context_length
    if max_total_tokens is None:
        max_total_tokens = PREFILL_POOL_CONTEXTS * (-(-context // page_size) * page_size)
    return CacheConfig(
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=max(2 * max_batch_size, 4),
        context_length=context,
        chunked_prefill_size=chunked_prefill_size,
        enable_hierarchical_cache=enable_hierarchical_cache,
        tp_size=tp_size,
        disaggregation_mode="prefill",
    )


def prefill_server(
    model: LoadedModel,
    config: CacheConfig,
    *,
    port: int,
    host: str = "127.0.0.1",
    max_batch_size: int = 16,
    overlap: bool = True,
    secret: Any = None,
    group: ProcessGroup | None = None,
) -> PrefillServer:
    """A `PrefillServer` for ``model`` over a cache built from ``config`` (``--tp``: over the
    first ``tp_size`` local devices; with ``group``, ``tp_size`` devices taken evenly from every
    process of the group, one server of several processes), its bootstrap endpoint on
    ``host:port`` (0: a free port; process 0's)."""
    cache = build_kv_cache(model.spec, config, mesh=_mesh(config.tp_size, group))
    scheduler = Scheduler(
        model.config,
        cache,
        model.params,
        max_batch_size=max_batch_size,
        chunked_prefill_size=config.chunked_prefill_size,
        overlap=overlap,
        **_agreement(group),
    )
    channel = None if group is None else group.channel
    return PrefillServer(scheduler, fingerprint=model.fingerprint, secret=secret, host=host, port=port, channel=channel)


def _mesh(tp_size: int, group: ProcessGroup | None) -> Any:
    """The side's mesh: ``tp_size`` local devices, or over the group's processes."""
    if group is None:
        return tp_mesh(tp_size)
    from kvjax.serve.multihost.mesh import group_tp_mesh

    return group_tp_mesh(tp_size)


def _agreement(group: ProcessGroup | None) -> dict[str, Any]:
    """The scheduler's agreement over a group (its asynchronous completions agreed), or nothing."""
    return {} if group is None else {"agreement": group.agreement()}


def decode_generate(
    model: LoadedModel,
    prompts: Sequence[Sequence[int]],
    *,
    prefill: Sequence[str],
    max_new_tokens: int,
    timeout_s: float = 30.0,
    decode_radix_cache: bool = False,
    page_size: int = 16,
    max_total_tokens: int | None = None,
    chunked_prefill_size: int = 512,
    max_batch_size: int = 16,
    stop_token_ids: Sequence[int] | None = None,
    enable_hierarchical_cache: bool = False,
    overlap: bool = True,
    tp_size: int = 1,
    on_step: StepCallback | None = None,
    cache_salts: Sequence[str | None] | None = None,
    priorities: Sequence[int] | None = None,
    retention_seconds: Sequence[float | None] | None = None,
    kv_events: Any = None,
    secret: Any = None,
    group: ProcessGroup | None = None,
    host: str = "127.0.0.1",
) -> tuple[GenerateResult, DecodeServer]:
    """``generate``'s run with every prompt computed on one of the ``prefill`` servers (bootstrap
    addresses; round robin) and decoded here (see the module docstring); with ``group``, by a
    decode server of several processes (every process of the group calls it with the same
    arguments; ``tp_size`` devices taken evenly from each); ``host``: the interface its transfer
    servers bind to. A request that failed (its prefill server lost (after the next prefill
    server, if any, was tried), silent past ``timeout_s``, or its KV not moved) ends with
    ``abort_reason`` set and the tokens it had; the server's ``failed`` lists them. Raises what
    connecting raises (``LinkError``, ``PDRefused``) before anything is served."""
    prompts = _checked_prompts(model, prompts, max_new_tokens)
    retained = _per_prompt(prompts, priorities, retention_seconds)
    reqs = _requests(model, prompts, max_new_tokens, stop_token_ids, cache_salts, retained)
    config = _config(
        model,
        prompts,
        max_new_tokens,
        page_size,
        max_total_tokens,
        chunked_prefill_size,
        max_batch_size,
        tp_size,
        enable_hierarchical_cache=enable_hierarchical_cache,
    ).replace(
        # generate's pool is sized to its prompts: retracted requests are backed up as host
        # tensors (the decode default, a host pool, would need a host tier sized for a context)
        disaggregation_mode="decode",
        disaggregation_decode_retraction_backup="cpu_tensor",
        disaggregation_decode_enable_radix_cache=decode_radix_cache,
    )
    cache = build_kv_cache(model.spec, config, mesh=_mesh(tp_size, group))
    scheduler = Scheduler(
        model.config,
        cache,
        model.params,
        max_batch_size=max_batch_size,
        chunked_prefill_size=chunked_prefill_size,
        overlap=overlap,
        **_agreement(group),
    )
    server = DecodeServer(
        scheduler,
        fingerprint=model.fingerprint,
        prefill=list(prefill),
        secret=secret,
        timeout_s=timeout_s,
        channel=None if group is None else group.channel,
        host=host,
    )
    try:
        events = kv_events if group is None else _events_here(kv_events, group)  # a group: process 0's
        _serve_with_events(scheduler, events, lambda: _serve_in_order(server, reqs, on_step))
    finally:
        server.close()
    result = _result(reqs, scheduler.stats)
    # as colocated: the prompts' tokens, and those the tree here held (the rest was pulled)
    result.prompt_tokens = sum(len(p) for p in prompts)
    result.cached_tokens = server.reused_tokens
    result.disaggregation = disaggregation_counters([server])
    prompt = {req.rid: i + 1 for i, req in enumerate(reqs)}
    result.disaggregation["failed"] = [{"prompt": prompt[r.rid], "reason": r.abort_reason} for r in server.failed]
    return result, server


def _serve_in_order(server: DecodeServer, reqs: list[ServingReq], on_step: StepCallback | None) -> None:
    """Submit the requests one at a time, each once the one before it holds its KV here (pulled,
    or ended), as ``generate`` does, then step until every request ended."""

    def step() -> None:
        server.step()
        if on_step is not None:
            on_step(reqs)

    for req in reqs:
        server.submit([req])
        while req.rid in server.rooms and server.rooms[req.rid].state != "pulled":
            step()
    while not server.idle:
        step()


def disaggregation_counters(servers: Sequence[DecodeServer]) -> dict[str, Any]:
    """What decode servers report: tokens pulled from prefill servers, tokens their own trees
    held already, KV pulls and their seconds, the prompts sent again to another prefill server,
    the requests that failed."""
    return dict(
        prefill_servers=len({p.address for s in servers for p in s.peers}),
        pulled_tokens=sum(s.pulled_tokens for s in servers),
        reused_tokens=sum(s.reused_tokens for s in servers),
        pulls=sum(s.pulls for s in servers),
        transfer_seconds=round(sum(s.transfer_seconds for s in servers), 4),
        retried_requests=sum(s.retried for s in servers),
        failed_requests=sum(len(s.failed) for s in servers),
    )
