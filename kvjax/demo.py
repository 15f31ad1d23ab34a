"""The main job (``python -m kvjax demo``): serve a reuse-heavy workload with the tiny model.

It builds a KV cache for the built-in tiny model (random weights), or for a Hugging Face
checkpoint directory (``--model DIR``, ``kvjax.serve.checkpoint``), on the default device (CPU here, the TPU when
present), runs the built-in workload (shared system prompts and multi-turn chats) through the
continuous-batching loop twice — once with the radix cache disabled (cold), once enabled (warm) —
and reports what the cache did: hit rate, evictions, retractions, throughput, the leak check
(``available + evictable + protected == capacity`` once all requests are done) and whether the warm
run produced exactly the cold run's greedy tokens.

The cold run goes first so that it also compiles the step for every batch shape; the warm run,
which the throughput figure comes from, then runs on compiled code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from kvjax.build import KVCache, build_kv_cache
from kvjax.demo_config import CONTEXT_LENGTH, DEMO_MODEL, MAX_BATCH, check_demo, demo_config, demo_context_length
from kvjax.dp.lockstep import LockstepDPScheduler
from kvjax.dp.speculative import RankDraft, rank_reports
from kvjax.mesh_check import make_serving_mesh
from kvjax.multihost.agreement import Agreement
from kvjax.multihost.process_group import ProcessGroup
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.model import init_params
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.model_fingerprint import random_weights_fingerprint
from kvjax.serve.multihost.front import MultiProcessFront
from kvjax.serve.multihost.mesh import group_dp_mesh, group_tp_mesh
from kvjax.serve.scheduler import Scheduler, ServeStats
from kvjax.serve.tp_mesh import tp_mesh
from kvjax.serve.workload import Workload, run_workload
from kvjax.spec import ModelSpec

__all__ = ["CONTEXT_LENGTH", "DEMO_MODEL", "MAX_BATCH", "DemoReport", "demo_cache", "demo_config", "run_demo", "serve"]


@dataclass
class DemoReport:
    """What the warm run did, and whether it held together. Tokens are totals over the workload."""

    model: str
    platform: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    prefill_tokens_computed: int
    cold_prefill_tokens_computed: int
    generated_tokens: int
    tokens_per_second: float
    peak_pool_occupancy: float
    pool_tokens: int
    evicted_tokens: int
    retractions: int
    leak_free: bool
    cold_equals_warm: bool
    seconds: float
    plan_text: str = dataclasses.field(repr=False)
    tree_text: str = dataclasses.field(repr=False)
    # With the host tier (--enable-hierarchical-cache): the same warm run without it, and what
    # the host tier loaded back; None without the host tier.
    cached_tokens_without_host_tier: int | None = None
    host_loaded_tokens: int | None = None
    host_pool_tokens: int | None = None
    host_balanced: bool | None = None
    # With --hicache-storage DIR: tokens the warm run prefetched from the storage tier (L3).
    storage_prefetched_tokens: int | None = None
    # A multi-process run (``kvjax.multihost``): the group's size and this process's id.
    processes: int = 1
    process_id: int = 0
    # With KVJAX_CHECK_AGREEMENT=1 in a multi-process run: state digests compared (all equal).
    digest_checks: int | None = None
    # A fingerprint of the warm run's greedy tokens (every request's, by name), to compare runs.
    outputs_fingerprint: str = ""
    # The host tier was asked for but the plan has none for this model's tree (the plan's
    # warning says why, e.g. a pure sliding-window tree); None when it was not asked for.
    host_tier_dropped: str | None = None
    # DP attention (--dp M): the ranks, the routing policy, and per rank (warm run) the requests
    # routed to it and its hit rate; the figures above are totals over the ranks (pool_tokens:
    # every rank's pool together). None with one rank.
    dp_size: int = 1
    dp_routing: str | None = None
    rank_requests: list[int] | None = None
    rank_hit_rates: list[float] | None = None
    # With a draft model (--speculative-algorithm STANDALONE): the warm run's acceptance counters.
    speculative: dict | None = None
    # With --kv-events-config: the KV events and batches the warm run published (every rank's).
    kv_events_published: int | None = None
    kv_event_batches_published: int | None = None

    @property
    def ok(self) -> bool:
        return self.leak_free and self.cold_equals_warm and self.host_balanced is not False

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("plan_text")
        d.pop("tree_text")
        return d

    def __str__(self) -> str:
        check = lambda ok: "ok" if ok else "FAILED"  # noqa: E731
        return "\n".join(
            [
                self.plan_text,
                "",
                f"served {self.requests} requests on {self.platform} ({self.model} model){self._processes_text}, "
                "warm radix cache:",
                f"  prompt tokens      {self.prompt_tokens:>10,}",
                f"  cached tokens      {self.cached_tokens:>10,}   hit rate {self.hit_rate:.1%}",
                f"  prefill computed   {self.prefill_tokens_computed:>10,}   "
                f"(cold run: {self.cold_prefill_tokens_computed:,})",
                f"  generated tokens   {self.generated_tokens:>10,}   {self.tokens_per_second:,.0f} tokens/s",
                f"  peak pool use      {self.peak_pool_occupancy:>10.1%}   of {self.pool_tokens:,} tokens",
                f"  evicted tokens     {self.evicted_tokens:>10,}",
                f"  retractions        {self.retractions:>10,}",
                f"  leak check (available + evictable + protected == capacity): {check(self.leak_free)}",
                f"  cold == warm (same greedy tokens with the radix cache off): {check(self.cold_equals_warm)}",
            ]
            + self._dp_lines()
            + self._agreement_lines()
            + self._host_lines(check)
            + self._speculative_lines()
            + self._kv_events_lines()
        )

    def _kv_events_lines(self) -> list[str]:
        if self.kv_events_published is None:
            return []
        return [f"KV events: {self.kv_events_published:,} published in {self.kv_event_batches_published:,} batches"]

    def _dp_lines(self) -> list[str]:
        if self.rank_hit_rates is None or self.rank_requests is None:
            return []
        lines = [f"DP attention: {self.dp_size} ranks, {self.dp_routing} routing"]
        for rank, (n, rate) in enumerate(zip(self.rank_requests, self.rank_hit_rates, strict=True)):
            lines.append(f"  rank {rank}: {n:>4} requests   hit rate {rate:.1%}")
        return lines

    def _speculative_lines(self) -> list[str]:
        sp = self.speculative
        if sp is None:
            return []
        return [
            f"speculative decoding ({sp['num_steps']} draft tokens per round):",
            f"  accepted           {sp['accepted_tokens']:>10,}   of {sp['proposed_tokens']:,} draft tokens "
            f"({sp['acceptance_rate']:.1%})",
            f"  tokens per target step {sp['accept_length']:>6.2f}",
        ]

    @property
    def _processes_text(self) -> str:
        return "" if self.processes == 1 else f" as process {self.process_id} of {self.processes}"

    def _agreement_lines(self) -> list[str]:
        if self.digest_checks is None:
            return []
        return [f"  agreement check: {self.digest_checks:,} step digests equal on all {self.processes} processes"]

    def _host_lines(self, check: Any) -> list[str]:
        if self.host_tier_dropped is not None:
            return [f"host tier: not attached ({self.host_tier_dropped})"]
        if self.host_loaded_tokens is None:
            return []
        return (
            [
                f"host tier ({self.host_pool_tokens:,} host tokens):",
                f"  cached tokens      {self.cached_tokens:>10,}   without the host tier: "
                f"{self.cached_tokens_without_host_tier:,}",
                f"  loaded back        {self.host_loaded_tokens:>10,}   tokens (host -> device)",
            ]
            + (
                []
                if self.storage_prefetched_tokens is None
                else [f"  from storage       {self.storage_prefetched_tokens:>10,}   tokens (storage -> host)"]
            )
            + [
                f"  host pool check (available + evictable + protected == capacity): {check(self.host_balanced)}",
            ]
        )


def demo_cache(
    *,
    spec: ModelSpec | None = None,
    draft_spec: ModelSpec | None = None,
    group: ProcessGroup | None = None,
    **config_kwargs,
) -> KVCache:
    """The cache the demo builds (``demo_config`` settings) for ``spec`` (default: the tiny
    model), for notebooks and tests; with ``tp_size`` above 1, sharded over that many local
    devices (``kvjax.serve.tp_mesh``; the same devices under decode context parallelism, which
    divides them), or
    with ``group`` over every process's devices (``kvjax.serve.multihost.mesh``); ``draft_spec``: a
    speculative draft model's pool too."""
    spec = spec or ModelSpec.preset(DEMO_MODEL)
    config_kwargs.setdefault("context_length", demo_context_length(spec))
    tp_size = config_kwargs.get("tp_size", 1)
    dcp_size = config_kwargs.get("dcp_size", 1)
    mesh = tp_mesh(tp_size, dcp_size) if group is None else group_tp_mesh(tp_size, dcp_size)
    return build_kv_cache(spec, demo_config(**config_kwargs), mesh=mesh, draft_spec=draft_spec)


def serve(
    workload: Workload,
    *,
    model: LoadedModel | None = None,
    progress: bool = False,
    seed: int = 0,
    force_miss: bool = False,
    overlap: bool = True,
    dp_routing: str = "cache_aware",
    draft: LoadedModel | None = None,
    speculative_num_steps: int = 3,
    group: ProcessGroup | None = None,
    kv_events: Any = None,
    **config_kwargs,
) -> tuple[Scheduler | LockstepDPScheduler, dict]:
    """Build a fresh cache, run ``workload`` through a scheduler; return it and the outputs by request.

    ``model``: a loaded checkpoint (default: the tiny model with weights from ``seed``); the
    workload's token ids are drawn below ``min(workload.vocab_size, the model's vocab)``.
    ``force_miss`` keeps the radix tree's code path but never lets it hit (to measure its overhead).
    ``overlap``: the scheduler's overlap scheduling (False: each step runs to completion first).
    ``dp_size`` above 1 (in ``config_kwargs``, with ``tp_size``): DP attention over
    ``make_serving_mesh``'s ``("data", "tp")`` mesh of the local devices (with ``group``, of
    every process's: ``group_dp_mesh``), served by a ``LockstepDPScheduler`` routing with
    ``dp_routing`` (with ``overlap``: overlap scheduling in every rank).
    ``draft``: decode speculatively with this STANDALONE draft (``speculative_num_steps`` per round).
    ``group``: serve as one process of a multi-process run (``kvjax.multihost``): the mesh spans
    every process, requests enter on process 0, completions are agreed.
    ``kv_events``: a ``KVEventsConfig``: the trees' KV events published on the wire
    (``kvjax.serve.kv_events``; one stream per DP rank; by process 0 only of a multi-process
    run), closed when the workload is done; the server's ``kv_event_streams`` holds them.
    """
    serving: ModelSpec | ModelConfig
    if model is None:
        spec = ModelSpec.preset(DEMO_MODEL)
        weights, serving = init_params(spec, seed=seed), spec
        fingerprint = random_weights_fingerprint(spec, seed)
    else:
        spec, weights, serving, fingerprint = model.spec, model.params, model.config, model.fingerprint
        workload = dataclasses.replace(workload, vocab_size=min(workload.vocab_size, model.config.vocab_size))
    if config_kwargs.get("hicache_storage_backend") is not None:
        # a stored page holds the draft's KV too (kvjax.transfers.storage_attach): key both weights
        both = fingerprint if draft is None else f"{fingerprint}+draft:{draft.fingerprint}"
        config_kwargs.setdefault("hicache_storage_model_fingerprint", both)
    if draft is not None:
        k = speculative_num_steps
        config_kwargs.update(
            speculative_algorithm="STANDALONE", speculative_num_steps=k, speculative_num_draft_tokens=k + 1
        )
    server: Scheduler | LockstepDPScheduler
    front: Any
    if config_kwargs.get("dp_size", 1) > 1:
        server = front = _dp_server(
            spec, serving, weights, dp_routing, overlap, config_kwargs, group, draft, speculative_num_steps
        )
        trees: list[Any] = [s.tree for s in server.schedulers]
    elif config_kwargs.get("pp_size", 1) > 1:
        server = front = _pipeline_server(spec, serving, weights, overlap, config_kwargs)
        trees = [server.tree]
    else:
        cache = demo_cache(spec=spec, draft_spec=None if draft is None else draft.spec, group=group, **config_kwargs)
        agreement = None if group is None else group.agreement()
        server = front = _single_server(serving, cache, weights, overlap, draft, speculative_num_steps, agreement)
        trees = [cache.tree_cache]
    if group is not None:
        front = MultiProcessFront(server, group.channel, check_agreement=group.check_agreement)
    for tree in trees:  # RadixCache and ChunkCache both have force_miss
        tree.force_miss = force_miss
    streams = None
    if kv_events is not None and (group is None or group.process_id == 0):
        from kvjax.serve.kv_events import attach_kv_events

        streams = attach_kv_events(server, kv_events)
    bar = _Progress(
        progress, workload.num_requests, "radix off" if config_kwargs.get("disable_radix_cache") else "radix on"
    )
    try:
        outputs = run_workload(front, workload, on_finish=lambda _: bar.advance())
    finally:
        if streams is not None:
            streams.close()
    bar.close()
    server.kv_event_streams = streams  # type: ignore[union-attr]
    if isinstance(front, MultiProcessFront) and group is not None:
        group.digest_checks += front.digest_checks
    return server, outputs


def _single_server(
    serving: ModelSpec | ModelConfig,
    cache: Any,
    weights: Any,
    overlap: bool,
    draft: LoadedModel | None,
    num_steps: int,
    agreement: Agreement | None,
) -> Scheduler:
    """The one scheduler of ``serve`` over ``cache``: a plain one (agreeing its host tier's
    completions through ``agreement`` when several processes serve), or with ``draft`` a
    scheduler proposing ``num_steps`` tokens per round."""
    if draft is None:
        return Scheduler(serving, cache, weights, max_batch_size=MAX_BATCH, overlap=overlap, agreement=agreement)
    from kvjax.serve.speculative import speculative_scheduler

    return speculative_scheduler(
        serving,
        cache,
        weights,
        draft=draft.config,
        draft_params=draft.params,
        num_steps=num_steps,
        max_batch_size=MAX_BATCH,
        overlap=overlap,
    )


def _dp_server(
    spec: ModelSpec,
    serving: ModelSpec | ModelConfig,
    weights: Any,
    routing: str,
    overlap: bool,
    config_kwargs: dict[str, Any],
    group: ProcessGroup | None,
    draft: LoadedModel | None = None,
    num_steps: int = 3,
) -> LockstepDPScheduler:
    """The lockstep DP front of ``serve`` over the local devices, or with ``group`` over every
    process's (``group_dp_mesh``: every process runs this same front, every rank's scheduler),
    with overlap scheduling unless ``overlap`` is False; with ``draft`` every rank proposes
    ``num_steps`` tokens per round (``kvjax.dp.speculative``);
    ``ConfigError`` naming ``tp_size`` when there are fewer than ``tp_size`` (nothing is built)."""
    import jax

    tp, dp, dcp = config_kwargs.get("tp_size", 1), config_kwargs["dp_size"], config_kwargs.get("dcp_size", 1)
    local = jax.local_devices()
    mesh = make_serving_mesh(tp, dp, True, devices=local, dcp_size=dcp) if group is None else group_dp_mesh(tp, dp, dcp)
    config_kwargs.setdefault("context_length", demo_context_length(spec))
    config = demo_config(**config_kwargs, enable_dp_attention=True)
    return LockstepDPScheduler.build_lockstep(
        spec,
        config,
        weights,
        mesh,
        policy=routing,
        max_batch_size=MAX_BATCH,
        model_config=serving if isinstance(serving, ModelConfig) else None,
        overlap=overlap,
        draft=None if draft is None else RankDraft(draft.params, num_steps, spec=draft.spec, config=draft.config),
    )


# Micro-batches of a pipeline-parallel demo step (two: stage s on one while stage s + 1 runs the other).
PP_MICRO_BATCHES = 2


def _pipeline_server(
    spec: ModelSpec, serving: ModelSpec | ModelConfig, weights: Any, overlap: bool, config_kwargs: dict[str, Any]
) -> Scheduler:
    """The pipeline-parallel scheduler of ``serve``: ``pp_size`` stages of ``tp_size`` local
    devices (``kvjax.serve.pipeline_cache``), two micro-batches a step."""
    from kvjax.serve.pipeline_cache import build_pipeline_cache
    from kvjax.serve.pipeline_stepping import pipeline_scheduler

    config_kwargs.setdefault("context_length", demo_context_length(spec))
    pipeline = build_pipeline_cache(spec, demo_config(**config_kwargs))
    return pipeline_scheduler(
        serving, pipeline, weights, micro_batches=PP_MICRO_BATCHES, max_batch_size=MAX_BATCH, overlap=overlap
    )


def run_demo(
    *,
    workload: Workload | None = None,
    page_size: int = 16,
    max_total_tokens: int = 16384,
    chunked_prefill_size: int = 512,
    eviction_policy: str = "lru",
    progress: bool = True,
    model: LoadedModel | None = None,
    enable_hierarchical_cache: bool = False,
    hicache_storage: str | None = None,
    overlap: bool = True,
    tp_size: int = 1,
    dp_size: int = 1,
    dp_routing: str = "cache_aware",
    draft: LoadedModel | None = None,
    speculative_num_steps: int = 3,
    dcp_size: int = 1,
    group: ProcessGroup | None = None,
    pp_size: int = 1,
    kv_events: Any = None,
) -> DemoReport:
    """Serve the workload cold then warm and compare; see the module docstring. ``model``: a
    loaded checkpoint instead of the tiny model. ``enable_hierarchical_cache``: the warm run has a
    host tier, and a third run (warm, without it) gives the cached tokens to compare against (when
    the plan drops the host tier, as for a pure sliding-window tree, the report says so instead).
    ``hicache_storage``: a directory for the warm run's storage tier (L3, with the host tier).
    ``overlap``: overlap scheduling in every run (False: each step runs to completion first).
    ``tp_size``: every run tensor-parallel over that many local devices; ``dcp_size``: decode
    context parallelism dividing them (each request's KV striped over ``dcp_size`` of them). ``dp_size`` above 1:
    DP attention, the ``tp_size`` devices split into ``dp_size`` ranks (``serve``), requests
    routed by ``dp_routing``; the report adds each rank's requests and hit rate. ``draft``: every
    run decodes speculatively with this STANDALONE draft model (its rounds overlapped with ``overlap``,
    except under DP attention, where ``overlap`` must then be False).
    ``group``: this process's part of a multi-process run (``kvjax.multihost``; the mesh spans
    every process; the same scheduler, or DP front, on every process; tensor parallel or DP
    attention, with decode context parallelism or without). ``pp_size`` above 1: every run over
    that many pipeline stages of ``tp_size`` local devices each (``_pipeline_server``).
    ``kv_events``: a ``KVEventsConfig``: the warm run publishes its trees' KV events (``serve``);
    the report counts them."""
    workload = workload or Workload()
    if pp_size > 1 and (dp_size > 1 or group is not None):
        raise NotImplementedError("pipeline stages are served by one process without DP attention: drop dp_size")
    if group is not None and draft is not None:
        raise NotImplementedError(
            "several processes serve tensor parallel, DP attention and decode context parallelism only for now: drop "
            "the draft model"
        )
    # The cache every run and the up-front check share.
    cache: dict[str, Any] = dict(
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        chunked_prefill_size=chunked_prefill_size,
        eviction_policy=eviction_policy,
        tp_size=tp_size,
        dcp_size=dcp_size,
        **({"dp_size": dp_size} if dp_size > 1 else {}),
        **({"pp_size": pp_size} if pp_size > 1 else {}),
    )
    progress = progress and (group is None or group.process_id == 0)
    settings: dict[str, Any] = dict(
        cache, model=model, progress=progress, overlap=overlap, dp_routing=dp_routing, group=group
    )
    if draft is not None:
        settings.update(draft=draft, speculative_num_steps=speculative_num_steps)
    dropped: str | None = None
    if enable_hierarchical_cache:
        # A host tier kvjax cannot build for this model (NotImplementedError naming it) is refused
        # before anything is served; one the plan drops (with a warning) is reported as such.
        spec = ModelSpec.preset(DEMO_MODEL) if model is None else model.spec
        plan = check_demo(spec, workload, enable_hierarchical_cache=True, **cache)
        if not plan.attach_host_tier:
            dropped = _host_tier_warning(plan)
    cold, cold_out = serve(workload, disable_radix_cache=True, **settings)
    host: dict[str, Any] = {}
    if enable_hierarchical_cache and dropped is None:
        plain, _ = serve(workload, **settings)
        host["cached_tokens_without_host_tier"] = (
            plain.stats.cached_tokens if isinstance(plain, Scheduler) else plain.cached_tokens
        )
    start = time.perf_counter()
    storage: dict[str, Any] = {}
    if hicache_storage is not None:
        storage = dict(hicache_storage_backend="file", hicache_storage_dir=hicache_storage)
    warm, warm_out = serve(
        workload, enable_hierarchical_cache=enable_hierarchical_cache, kv_events=kv_events, **storage, **settings
    )
    seconds = time.perf_counter() - start
    events = _kv_event_counts(warm)
    if isinstance(warm, LockstepDPScheduler) and isinstance(cold, LockstepDPScheduler):
        if enable_hierarchical_cache and dropped is None:
            host.update(_dp_host_fields(warm, hicache_storage is not None))
        return dataclasses.replace(
            _dp_report(warm, cold, warm_out, cold_out, seconds, model, dp_routing, group),
            **host,
            **events,
            speculative=_speculative_counters(warm),
        )
    if not isinstance(warm, Scheduler) or not isinstance(cold, Scheduler):
        raise AssertionError("one rank: every run has one Scheduler")
    stats: ServeStats = warm.stats
    if dropped is not None:
        host["host_tier_dropped"] = dropped
    elif enable_hierarchical_cache:
        ext = _host_extension(warm)
        host.update(
            host_loaded_tokens=ext.loaded_tokens,
            host_pool_tokens=warm.cache.plan.host_pool_tokens,
            host_balanced=ext.host_balanced(),
        )
        if hicache_storage is not None:
            host["storage_prefetched_tokens"] = ext.prefetched_tokens
    return DemoReport(
        **_run_fields(warm, cold, warm_out, cold_out, seconds, model, group),
        requests=len(warm_out),
        prompt_tokens=stats.prompt_tokens,
        cached_tokens=stats.cached_tokens,
        hit_rate=round(stats.hit_rate, 4),
        prefill_tokens_computed=stats.prefill_tokens_computed,
        cold_prefill_tokens_computed=cold.stats.prefill_tokens_computed,
        generated_tokens=stats.generated_tokens,
        tokens_per_second=round(stats.generated_tokens / seconds, 1),
        peak_pool_occupancy=round(max(stats.occupancy, default=0.0), 4),
        pool_tokens=warm.alloc.size,
        evicted_tokens=stats.evicted_tokens,
        retractions=stats.retractions,
        tree_text=_tree_text(warm.cache.tree_cache),
        speculative=_speculative_counters(warm),
        **host,
        **events,
    )


def _kv_event_counts(server: Any) -> dict[str, Any]:
    """The report's KV event fields of a run that published them (``serve(kv_events=...)``)."""
    streams = getattr(server, "kv_event_streams", None)
    if streams is None:
        return {}
    return {"kv_events_published": streams.published_events, "kv_event_batches_published": streams.published_batches}


def _run_fields(
    warm: Scheduler | LockstepDPScheduler,
    cold: Scheduler | LockstepDPScheduler,
    warm_out: dict,
    cold_out: dict,
    seconds: float,
    model: LoadedModel | None,
    group: ProcessGroup | None,
) -> dict[str, Any]:
    """The report's fields of any run: the model and platform, the cold/warm checks, the time,
    the plan, and with ``group`` this process's place and the digests compared."""
    return dict(
        model=DEMO_MODEL if model is None else model.name,
        platform=warm.cache.plan.platform,
        leak_free=warm.leak_free() and cold.leak_free(),
        cold_equals_warm=cold_out == warm_out,
        outputs_fingerprint=outputs_fingerprint(warm_out),
        seconds=round(seconds, 2),
        plan_text=str(warm.cache.plan),
        processes=1 if group is None else group.num_processes,
        process_id=0 if group is None else group.process_id,
        digest_checks=None if group is None or not group.check_agreement else group.digest_checks,
    )


def _dp_report(
    warm: LockstepDPScheduler,
    cold: LockstepDPScheduler,
    warm_out: dict,
    cold_out: dict,
    seconds: float,
    model: LoadedModel | None,
    routing: str,
    group: ProcessGroup | None,
) -> DemoReport:
    """The report of a DP-attention run: totals over the ranks, and each rank's requests and hit
    rate (warm run); with ``group``, this process's place and the digests compared."""
    ranks = [s.stats for s in warm.schedulers]
    routed = list(warm.rank_of.values())
    generated = sum(st.generated_tokens for st in ranks)
    trees = [f"rank {r}:\n{_tree_text(s.tree)}" for r, s in enumerate(warm.schedulers)]
    return DemoReport(
        **_run_fields(warm, cold, warm_out, cold_out, seconds, model, group),
        requests=len(routed),
        prompt_tokens=warm.prompt_tokens,
        cached_tokens=warm.cached_tokens,
        hit_rate=round(warm.hit_rate, 4),
        prefill_tokens_computed=sum(st.prefill_tokens_computed for st in ranks),
        cold_prefill_tokens_computed=sum(s.stats.prefill_tokens_computed for s in cold.schedulers),
        generated_tokens=generated,
        tokens_per_second=round(generated / seconds, 1),
        peak_pool_occupancy=round(max((max(st.occupancy, default=0.0) for st in ranks), default=0.0), 4),
        pool_tokens=sum(s.alloc.size for s in warm.schedulers),
        evicted_tokens=sum(st.evicted_tokens for st in ranks),
        retractions=sum(st.retractions for st in ranks),
        tree_text="\n".join(trees),
        dp_size=warm.dp_size,
        dp_routing=routing,
        rank_requests=[routed.count(r) for r in range(warm.dp_size)],
        rank_hit_rates=[round(st.hit_rate, 4) for st in ranks],
    )


def _dp_host_fields(warm: LockstepDPScheduler, storage: bool) -> dict[str, Any]:
    """The host tier's report fields of a DP-attention run: every rank's own host tier, summed
    (balanced: on every rank)."""
    exts = [_host_extension(s) for s in warm.schedulers]
    fields: dict[str, Any] = dict(
        host_loaded_tokens=sum(e.loaded_tokens for e in exts),
        host_pool_tokens=sum(s.cache.plan.host_pool_tokens for s in warm.schedulers),
        host_balanced=all(e.host_balanced() for e in exts),
    )
    if storage:
        fields["storage_prefetched_tokens"] = sum(e.prefetched_tokens for e in exts)
    return fields


def _speculative_counters(scheduler: Scheduler | LockstepDPScheduler) -> dict | None:
    """A speculative run's counters (``DraftDecoding.report``; under DP attention the ranks'
    summed, ``rank_reports``), else None."""
    from kvjax.serve.speculative import DraftDecoding

    if isinstance(scheduler, LockstepDPScheduler):
        return rank_reports(scheduler.schedulers)
    proposer = scheduler.proposer
    return proposer.report() if isinstance(proposer, DraftDecoding) else None


def outputs_fingerprint(outputs: dict[str, list[int]]) -> str:
    """A short hash of every request's output tokens, by request name (equal outputs, equal hash)."""
    text = json.dumps(sorted(outputs.items()), separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _host_extension(scheduler: Scheduler) -> Any:
    from kvjax.serve.host_tier import HostTierExtension

    return next(e for e in scheduler.extensions if isinstance(e, HostTierExtension))


def _host_tier_warning(plan: Any) -> str:
    """Why the plan has no host tier: its warning about it, else the tree kind."""
    found = [w for w in plan.warnings if "enable_hierarchical_cache" in w]
    return found[0] if found else f"a {plan.tree_cache_kind!r} tree has no host tier"


def _tree_text(tree: Any) -> str:
    return str(tree.pretty_print())


class _Progress:
    """A rich progress bar over finished requests when asked for, else nothing."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self._bar = None
        if enabled:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.start()
            self._task = self._bar.add_task(f"demo ({label})", total=total)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
