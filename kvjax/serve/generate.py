"""Greedy generation through the whole stack: plan, build, radix cache, scheduler.

``resolve_model`` turns ``--model`` into a `LoadedModel` (a checkpoint directory, or a small
preset with random weights). ``generate`` serves several prompts as one workload on one cache:
prompt ``i + 1`` arrives once prompt ``i`` has been prefilled (its prompt is then in the radix
tree), so later prompts reuse the prefixes of earlier ones while all of them decode together.

Both serve as one process of a multi-process run when given its ``group``
(``kvjax.multihost``): the mesh spans every process's devices (``kvjax.serve.multihost.mesh``),
every process runs the same scheduler (or DP front) behind a ``MultiProcessFront``, the prompts
enter on process 0 and reach every process with the step they arrive at, so every process
serves them in the same steps and ends with the same outputs. Every process is given the same
prompts (the same command): before anything is built the processes compare a digest of their
requests (`PromptsDigest`), and any difference is a ``DivergenceError`` on every process.

Every check happens before the cache is built: prompts must be non-empty, their ids inside the
vocabulary, and prompt plus output inside the model's context; each failure is a `ConfigError`
naming the prompt, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvjax.build import build_kv_cache
from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.multihost.wire import wire_message
from kvjax.plan.sizing import MAMBA_EXTRA_BUFFER_STATES, MAMBA_STATES_PER_REQ_WITH_RADIX
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint, load_gguf
from kvjax.serve.model import init_params, param_shapes
from kvjax.serve.model_config import ModelConfig, model_config_from_spec
from kvjax.serve.model_fingerprint import random_weights_fingerprint
from kvjax.serve.scheduler import Scheduler, ServeStats, ServingReq
from kvjax.serve.speculative.nextn import NextNDraftModel
from kvjax.serve.tp_mesh import tp_mesh
from kvjax.spec import ModelSpec

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.dp.lockstep import LockstepDPScheduler
    from kvjax.multihost.process_group import ProcessGroup

#: Called after every scheduling step with every request of the workload (prompt order): how
#: ``generate`` streams (``ServingReq.output_ids`` holds the tokens so far, ``finished`` says done).
StepCallback = Callable[[Sequence[ServingReq]], None]


@wire_message("generate_prompts", version=1)
@dataclasses.dataclass(frozen=True)
class PromptsDigest:
    """What each process of a multi-process ``generate`` was asked to serve: the number of
    requests and a sha256 of them (prompt ids, generation limit, stop ids, salt, priority,
    retention, in prompt order)."""

    requests: int
    sha256: str


MAX_RANDOM_PARAMS = 200_000_000  # presets get random weights; beyond this, ask for a checkpoint
CONTEXT_ROUNDING = 64  # context (and so the page table) rounded up to this many tokens: fewer compiles


@dataclasses.dataclass
class GenerateResult:
    """Outputs in prompt order, and what the cache did (token counts over all prompts)."""

    outputs: list[list[int]]
    cached_tokens: int
    prompt_tokens: int
    stats: ServeStats
    speculative: dict | None = None  # with a draft model: acceptance counters (``SpeculativeStats``)
    # with images: the embedding cache's counters and the encoder's runs (``MultimodalExtension.stats``)
    multimodal: dict | None = None
    # served disaggregated (a decode server): its counters (``disaggregation.serving.decode_generate``)
    disaggregation: dict | None = None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {
            "outputs": self.outputs,
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
        }
        if self.speculative is not None:
            out["speculative"] = self.speculative
        if self.multimodal is not None:
            out["multimodal"] = self.multimodal
        if self.disaggregation is not None:
            out["disaggregation"] = self.disaggregation
        return out


def resolve_model(model: str, *, dtype: str | None = None) -> LoadedModel:
    """A checkpoint directory, a GGUF file (or an installed GGUF model's name, ``kvjax.gguf.locate``),
    or a preset name (random weights from seed 0, small presets only)."""
    from kvjax.gguf.locate import INSTALLED_MODELS, gguf_path

    path = Path(model)
    gguf = gguf_path(model)
    if gguf is not None:
        return load_gguf(gguf, dtype=dtype)
    if path.is_dir():
        return load_checkpoint(path, dtype=dtype)
    if model not in ModelSpec.presets():
        raise ConfigError(
            "model",
            model,
            f"is neither a checkpoint directory, a GGUF file nor a preset; pass a directory with config.json and "
            f"*.safetensors, a .gguf file, or one of {[*ModelSpec.presets(), *INSTALLED_MODELS]}",
        )
    spec = ModelSpec.preset(model)
    if dtype is not None:
        spec = dataclasses.replace(spec, dtype=dtype)
    config = model_config_from_spec(spec)
    count = parameter_count(config)
    if count > MAX_RANDOM_PARAMS:
        raise ConfigError(
            "model",
            model,
            f"the preset has {count:,} parameters; random weights are for small presets such as 'tiny' "
            "(pass a downloaded checkpoint directory instead)",
        )
    return LoadedModel(
        name=model,
        spec=spec,
        config=config,
        params=init_params(config),
        fingerprint=random_weights_fingerprint(config, seed=0),
    )


def parameter_count(config: ModelConfig) -> int:
    """Parameters of the model, from 1- and 2-layer shapes (layers are identical; nothing allocated)."""
    import jax

    def count(layers: int) -> int:
        shapes = param_shapes(config.replace(num_hidden_layers=layers))
        return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes))

    one, two = count(1), count(2)
    return one + (config.num_hidden_layers - 1) * (two - one)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Raise `ConfigError` for an empty prompt or an id outside ``[0, vocab_size)``."""
    if not prompts:
        raise ConfigError("prompt", None, "give at least one prompt (--prompt-ids 1,2,3 or --prompt TEXT)")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ConfigError(f"prompt {i + 1}", "", "is empty; give at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ConfigError(
                f"prompt {i + 1}",
                bad[:8],
                f"token ids must be in [0, {vocab_size}) (the model's vocab_size); fix the ids",
            )


# Micro-batches of a pipeline-parallel step (two: stage s runs one while stage s + 1 runs the other).
PP_MICRO_BATCHES = 2


def generate(
    model: LoadedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    page_size: int = 16,
    max_total_tokens: int | None = None,
    chunked_prefill_size: int = 512,
    max_batch_size: int = 16,
    stop_token_ids: Sequence[int] | None = None,
    record_logits: bool = False,
    enable_hierarchical_cache: bool = False,
    overlap: bool = True,
    tp_size: int = 1,
    draft: LoadedModel | NextNDraftModel | None = None,
    speculative_num_steps: int = 3,
    dcp_size: int = 1,
    pp_size: int = 1,
    on_step: StepCallback | None = None,
    cache_salts: Sequence[str | None] | None = None,
    priorities: Sequence[int] | None = None,
    retention_seconds: Sequence[float | None] | None = None,
    kv_events: Any = None,
    images: Sequence[Any] | None = None,
    image_encoder: Any = None,
    image_preprocessing: dict[str, Any] | None = None,
    vlm_cache_size_mb: int | None = None,
    group: ProcessGroup | None = None,
) -> tuple[GenerateResult, Scheduler]:
    """Greedy-generate up to ``max_new_tokens`` per prompt (see the module docstring).

    ``max_total_tokens``: KV pool size in tokens (default: room for every prompt and output, so
    nothing is evicted; make it small to force eviction and retraction). ``stop_token_ids``:
    default the model's end-of-sequence ids; ``()`` to always generate ``max_new_tokens``.
    ``enable_hierarchical_cache``: add the host tier (evicted prefixes kept in host memory).
    ``overlap``: overlap scheduling (``Scheduler``'s; False: each step runs to completion first).
    ``tp_size``: tensor parallelism over the first ``tp_size`` local devices (``tp_mesh``);
    ``dcp_size``: decode context parallelism dividing ``tp_size``: the KV heads over ``tp_size /
    dcp_size`` of those devices, each request's KV striped over ``dcp_size`` (``tp_mesh``).
    ``draft``: decode speculatively with this STANDALONE draft model, or with the target's MTP
    layer (a ``NextNDraftModel``, ``resolve_draft``: EAGLE / NEXTN), ``speculative_num_steps``
    tokens per round (``kvjax.serve.speculative``; rounds overlapped with ``overlap``). ``pp_size`` above 1:
    the layers split into that many pipeline stages of ``tp_size`` local devices each, two
    micro-batches a step (``kvjax.serve.pipeline_stepping``). ``on_step``: called after every
    step with every request (`StepCallback`; the command line streams text through it).
    ``cache_salts``: each prompt's tenant (``ServingReq``'s ``cache_salt``; prompts of different
    salts share no cached page). ``priorities`` / ``retention_seconds``: each prompt's priority and
    retention (``ServingReq``'s; a retained prefix is evicted last until its retention expires,
    ``kvjax.radix.retention``), one per prompt or None. ``kv_events``: a ``KVEventsConfig``: the
    tree's KV events published while serving (``kvjax.serve.kv_events``). ``images``: pixel values
    ``[C, H, W]`` for the prompts' image placeholders, in order, encoded by ``image_encoder`` (an
    ``ImageEncoder``) through an embedding cache of ``vlm_cache_size_mb`` MiB (default the
    ``CacheConfig``'s), hashed with ``image_preprocessing`` (``kvjax.serve.image_prompts``; one
    device or a tp mesh, no draft model). ``group``: serve as one process of a multi-process run
    (module docstring): ``tp_size`` devices taken evenly from every process (``group_tp_mesh``),
    host-tier completions agreed, KV events published by process 0 only, ``on_step`` called on
    process 0 only; a draft model's rounds run in step on every process like any other step;
    with ``dcp_size`` the ``("tp", "dcp")`` mesh of those devices (``group_tp_mesh``: a
    ``"dcp"`` row within one process when ``dcp_size`` divides a process's share); not with
    pipeline stages or images (``NotImplementedError``). Returns the
    result and the scheduler (its cache, tree and stats) for
    inspection.
    """
    if group is not None and (pp_size > 1 or images is not None):
        raise NotImplementedError(
            "several processes serve tensor parallel, DP attention, decode context parallelism and speculative "
            "decoding only for now: drop pp_size and the images"
        )
    if images is not None:
        refused = draft is not None or pp_size > 1 or dcp_size > 1
        prompts = _expanded_prompts(prompts, image_encoder, refused)
    prompts = _checked_prompts(model, prompts, max_new_tokens)
    retained = _per_prompt(prompts, priorities, retention_seconds)
    reqs = _requests(model, prompts, max_new_tokens, stop_token_ids, cache_salts, retained)  # checked before building
    _agree_on_requests(reqs, group)
    sizes = (page_size, max_total_tokens, chunked_prefill_size, max_batch_size, tp_size)
    config = _config(
        model,
        prompts,
        max_new_tokens,
        *sizes,
        enable_hierarchical_cache=enable_hierarchical_cache,
        dcp_size=dcp_size,
        extra_tokens=0 if draft is None else speculative_num_steps,  # a round's draft tokens past the end
    ).replace(**_speculative_config(draft, speculative_num_steps), pp_size=pp_size)
    if vlm_cache_size_mb is not None:
        config = config.replace(vlm_cache_size_mb=vlm_cache_size_mb)
    options: dict[str, Any] = dict(
        max_batch_size=max_batch_size, chunked_prefill_size=chunked_prefill_size, record_logits=record_logits
    )
    mm = None
    if images is not None:
        from kvjax.multimodal import EmbeddingCache
        from kvjax.serve.image_prompts import image_requests

        cache_of_images: EmbeddingCache[Any] = EmbeddingCache.from_config(config)
        mm, reqs = image_requests(
            reqs, images, image_encoder, cache_of_images, model.config.vocab_size, preprocessing=image_preprocessing
        )
    scheduler: Scheduler
    if pp_size > 1:
        from kvjax.serve.pipeline_cache import build_pipeline_cache
        from kvjax.serve.pipeline_stepping import pipeline_scheduler

        pipeline = build_pipeline_cache(model.spec, config)
        micro = min(PP_MICRO_BATCHES, max_batch_size)
        if isinstance(draft, NextNDraftModel):  # EAGLE / NEXTN: the draft on the last stage
            from kvjax.serve.pipeline_eagle import pipeline_eagle_scheduler

            scheduler = pipeline_eagle_scheduler(
                model.config,
                pipeline,
                model.params,
                draft_params=draft.params,
                num_steps=speculative_num_steps,
                micro_batches=micro,
                overlap=overlap,
                **options,
            )
        else:
            scheduler = pipeline_scheduler(
                model.config, pipeline, model.params, micro_batches=micro, overlap=overlap, **options
            )
    else:
        mesh = tp_mesh(tp_size, dcp_size) if group is None else _group_tp_mesh(tp_size, dcp_size)
        cache = build_kv_cache(model.spec, config, mesh=mesh, draft_spec=_draft_spec(draft))
        if mm is not None:
            from kvjax.serve.kinds import default_extensions

            options["extensions"] = [*default_extensions(cache), mm]
        if group is not None:
            options["agreement"] = group.agreement()  # the host tier's completions, agreed
        scheduler = scheduler_for(
            model, cache, draft=draft, num_steps=speculative_num_steps, overlap=overlap, **options
        )
    front = _front(scheduler, group)
    _serve_with_events(
        scheduler,
        _events_here(kv_events, group),
        lambda: _serve_in_order(front, reqs, lambda req: scheduler, _steps_here(on_step, group), group is not None),
    )
    result = _result(_served(front, reqs, group), scheduler.stats, _speculative_counters(scheduler))
    result.multimodal = None if mm is None else mm.stats()
    return result, scheduler


def _expanded_prompts(prompts: Sequence[Sequence[int]], encoder: Any, refused: bool) -> list[list[int]]:
    """The prompts with lone image placeholders expanded (``image_prompts.expand_placeholders``);
    `ConfigError` without an encoder, or with a draft model, pipeline stages or decode context
    parallelism (``refused``: not served with images yet)."""
    if encoder is None:
        raise ConfigError("images", "given", "images need the model's image encoder (load_image_encoder)")
    if refused:
        raise ConfigError(
            "images",
            "given",
            "images are served on one device or a tp mesh, without a draft model; drop --dcp, --pp and the draft",
        )
    from kvjax.serve.image_prompts import expand_placeholders

    return [expand_placeholders(p, encoder.placeholder_token_id, encoder.tokens_per_image)[0] for p in prompts]


def scheduler_for(
    model: LoadedModel,
    cache: KVCache,
    *,
    draft: LoadedModel | NextNDraftModel | None = None,
    num_steps: int = 3,
    **options: Any,
) -> Scheduler:
    """The scheduler serving ``model`` over ``cache``: a ``Scheduler``, or with a STANDALONE
    ``draft`` model a scheduler drafting ``num_steps`` tokens a round (the cache
    built with ``draft_spec=draft.spec`` and the speculative fields set), or with the target's MTP
    layer (a ``NextNDraftModel``; the cache built with ``speculative_algorithm="NEXTN"``) an
    EAGLE-style one. ``options`` go to the scheduler (``max_batch_size``, ``chunked_prefill_size``,
    ``record_logits``, ``overlap``, ...)."""
    if draft is None:
        return Scheduler(model.config, cache, model.params, **options)
    if isinstance(draft, NextNDraftModel):
        from kvjax.serve.speculative.eagle import eagle_scheduler

        return eagle_scheduler(
            model.config,
            cache,
            model.params,
            draft_params=draft.params,
            num_steps=num_steps,
            eagle3=draft.eagle3,
            **options,
        )
    from kvjax.serve.speculative import speculative_scheduler

    return speculative_scheduler(
        model.config, cache, model.params, draft=draft.config, draft_params=draft.params, num_steps=num_steps, **options
    )


def generate_dp(
    model: LoadedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    dp_size: int,
    tp_size: int,
    dp_routing: str = "cache_aware",
    dcp_size: int = 1,
    pp_size: int = 1,
    page_size: int = 16,
    max_total_tokens: int | None = None,
    chunked_prefill_size: int = 512,
    max_batch_size: int = 16,
    stop_token_ids: Sequence[int] | None = None,
    record_logits: bool = False,
    enable_hierarchical_cache: bool = False,
    overlap: bool = True,
    on_step: StepCallback | None = None,
    cache_salts: Sequence[str | None] | None = None,
    priorities: Sequence[int] | None = None,
    retention_seconds: Sequence[float | None] | None = None,
    kv_events: Any = None,
    group: ProcessGroup | None = None,
    draft: LoadedModel | NextNDraftModel | None = None,
    speculative_num_steps: int = 3,
) -> tuple[GenerateResult, LockstepDPScheduler]:
    """``generate`` under DP attention (SGLang's ``--dp M --enable-dp-attention``): the first
    ``tp_size`` local devices as a ``("data", "tp")`` mesh of ``dp_size`` ranks
    (``make_serving_mesh``), each with its own tree, request table, allocator and a pool of
    ``max_total_tokens`` (default: room for every prompt); every prompt is routed by
    ``dp_routing`` (``kvjax.serve.dp_router``) when the one before it has been prefilled, and
    every round runs one device step for all ranks (``LockstepDPScheduler``, with overlap
    scheduling unless ``overlap`` is False; ``on_step``, ``cache_salts``, ``priorities`` and
    ``retention_seconds`` as ``generate``'s; ``enable_hierarchical_cache``: a host tier per
    rank). The result's counts and ``stats`` are totals over the ranks. ``group``: as
    ``generate``'s, over every process's devices (``group_dp_mesh``, ranks in process order;
    every process runs every rank's scheduler).

    ``dcp_size``: decode context parallelism dividing each rank's ``tp_size / dp_size`` devices (the
    mesh ``("data", "tp", "dcp")``: each rank's KV striped over ``dcp_size`` of them; with ``group``
    over every process's devices, ``group_dp_mesh``). ``pp_size`` above 1: the layers over that
    many stages of ``tp_size`` local devices each, every stage's attention per rank
    (``kvjax.dp.pipeline``; one process).
    ``draft`` / ``speculative_num_steps``: as ``generate``'s: every rank decodes speculatively
    (``kvjax.dp.speculative``: each rank's rounds and paired prefills in one DP program per kind of
    step; with ``overlap`` a rank's rounds are chained on the device); the result's counters are
    summed over the ranks.

    Raises ``ConfigError`` as ``generate`` does, naming ``dp_size`` when it does not divide
    ``tp_size``, ``dcp_size`` when it does not divide ``tp_size / dp_size``, and ``tp_size`` when there are
    fewer local devices; nothing is built then.
    """
    import jax

    from kvjax.dp.lockstep import LockstepDPScheduler
    from kvjax.mesh_check import make_serving_mesh

    prompts = _checked_prompts(model, prompts, max_new_tokens)
    retained = _per_prompt(prompts, priorities, retention_seconds)
    reqs = _requests(model, prompts, max_new_tokens, stop_token_ids, cache_salts, retained)  # checked before building
    _agree_on_requests(reqs, group)
    sizes = (page_size, max_total_tokens, chunked_prefill_size, max_batch_size, tp_size)
    config = _config(
        model,
        prompts,
        max_new_tokens,
        *sizes,
        enable_hierarchical_cache=enable_hierarchical_cache,
        dcp_size=dcp_size,
        dp_size=dp_size,
        extra_tokens=0 if draft is None else speculative_num_steps,  # a round's draft tokens past the end
    ).replace(
        dp_size=dp_size, enable_dp_attention=True, pp_size=pp_size, **_speculative_config(draft, speculative_num_steps)
    )
    mesh: Any
    if pp_size > 1:
        if group is not None:
            raise ConfigError(
                "pp_size", pp_size, "pipeline stages are served in one process; drop pp_size or the group"
            )
        from kvjax.dp.pipeline import dp_stage_meshes

        mesh = dp_stage_meshes(config)
    elif group is None:
        mesh = make_serving_mesh(tp_size, dp_size, True, devices=jax.local_devices(), dcp_size=dcp_size)
    else:
        from kvjax.serve.multihost.mesh import group_dp_mesh

        mesh = group_dp_mesh(tp_size, dp_size, dcp_size)
    server = LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        mesh,
        policy=dp_routing,
        max_batch_size=max_batch_size,
        chunked_prefill_size=chunked_prefill_size,
        record_logits=record_logits,
        model_config=model.config,
        overlap=overlap,
        draft=_rank_draft(draft, speculative_num_steps),
    )
    front = _front(server, group)
    _serve_with_events(
        server,
        _events_here(kv_events, group),
        lambda: _serve_in_order(
            front,
            reqs,
            lambda req: server.schedulers[server.rank_of[req.rid]],
            _steps_here(on_step, group),
            group is not None,
        ),
    )
    from kvjax.dp.speculative import rank_reports

    counters = rank_reports(server.schedulers)
    return _result(_served(front, reqs, group), _summed([s.stats for s in server.schedulers]), counters), server


def _agree_on_requests(reqs: list[ServingReq], group: ProcessGroup | None) -> None:
    """With ``group``: compare every process's `PromptsDigest` of ``reqs`` (one exchange);
    ``DivergenceError`` (step 0) on every process naming the first process whose requests differ
    from process 0's (only process 0's are served, and every process must make the same calls)."""
    if group is None:
        return
    from kvjax.multihost.channel import all_gather_message
    from kvjax.multihost.errors import DivergenceError

    fields = [
        [list(r.origin_input_ids), r.max_new_tokens, sorted(r.stop_token_ids), r.extra_key, r.priority]
        + [r.retention_seconds]
        for r in reqs
    ]
    sha256 = hashlib.sha256(json.dumps(fields, default=str).encode()).hexdigest()
    digests = all_gather_message(group.channel, "generate prompts", PromptsDigest(len(reqs), sha256))
    for q, digest in enumerate(digests):
        if digest != digests[0]:
            what = (
                f"{digest.requests} prompt(s) and process 0 {digests[0].requests}"
                if digest.requests != digests[0].requests
                else "other prompts (or generation flags) than process 0"
            )
            raise DivergenceError(
                0,
                f"process {q} was given {what}; every process of a multi-process generate runs the same "
                "command (the same prompts and generation flags)",
            )


def _group_tp_mesh(tp_size: int, dcp_size: int = 1) -> Any:
    """``group_tp_mesh`` (imported when a group serves)."""
    from kvjax.serve.multihost.mesh import group_tp_mesh

    return group_tp_mesh(tp_size, dcp_size)


def _front(server: Any, group: ProcessGroup | None) -> Any:
    """What serves the requests: ``server`` itself, or with ``group`` a ``MultiProcessFront``
    over it (every process's digests compared with the group's ``check_agreement``)."""
    if group is None:
        return server
    from kvjax.serve.multihost.front import MultiProcessFront

    return MultiProcessFront(server, group.channel, check_agreement=group.check_agreement)


def _events_here(kv_events: Any, group: ProcessGroup | None) -> Any:
    """``kv_events`` where this process publishes them: alone, or as process 0 of a group."""
    return kv_events if group is None or group.process_id == 0 else None


def _steps_here(on_step: StepCallback | None, group: ProcessGroup | None) -> StepCallback | None:
    """``on_step`` where the requests given are the ones served: alone, or on process 0."""
    return on_step if group is None or group.process_id == 0 else None


def _served(front: Any, reqs: list[ServingReq], group: ProcessGroup | None) -> list[ServingReq]:
    """The requests as served, in prompt order: ``reqs`` alone or on process 0 (the front
    submitted them); elsewhere the ones made from process 0's broadcast, found by id. With a
    group, adds the front's digest checks to the group's."""
    if group is None:
        return reqs
    group.digest_checks += front.digest_checks
    finished = {req.rid: req for req in front.finished}
    return [finished[req.rid] for req in reqs]


def _serve_with_events(server: Any, kv_events: Any, serve: Callable[[], None]) -> None:
    """Run ``serve`` with ``server``'s KV events published per ``kv_events`` (a
    ``KVEventsConfig``, ``--kv-events-config``; None: none), closed when it ends;
    ``server.kv_event_streams`` keeps the streams (their counts)."""
    if kv_events is None:
        serve()
        return
    from kvjax.serve.kv_events import attach_kv_events

    streams = attach_kv_events(server, kv_events)
    server.kv_event_streams = streams
    try:
        serve()
    finally:
        streams.close()


class _Front(Protocol):
    """What ``_serve_in_order`` drives: a scheduler, or the lockstep front of DP ranks."""

    @property
    def idle(self) -> bool: ...

    def submit(self, reqs: list[ServingReq]) -> Any: ...

    def step(self) -> Any: ...


def _requests(
    model: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None,
    cache_salts: Sequence[str | None] | None = None,
    retained: Sequence[tuple[int, float | None]] | None = None,
) -> list[ServingReq]:
    """One request per prompt, ids in prompt order, stopping at ``stop_token_ids`` (default: the
    model's stop tokens), each in its tenant's namespace (``cache_salts``: one per prompt, or none)
    with its ``(priority, retention_seconds)`` (``retained``: one per prompt, or none)."""
    stops = model.stop_token_ids if stop_token_ids is None else tuple(stop_token_ids)
    salts = [None] * len(prompts) if cache_salts is None else list(cache_salts)
    if len(salts) != len(prompts):
        raise ConfigError("cache_salts", len(salts), f"give one cache salt per prompt ({len(prompts)}), or none")
    keep = [(0, None)] * len(prompts) if retained is None else list(retained)
    return [
        ServingReq(
            i,
            p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stops,
            cache_salt=salt,
            priority=priority,
            retention_seconds=seconds,
        )
        for i, (p, salt, (priority, seconds)) in enumerate(zip(prompts, salts, keep, strict=True))
    ]


def _per_prompt(
    prompts: Sequence[Sequence[int]],
    priorities: Sequence[int] | None,
    retention_seconds: Sequence[float | None] | None,
) -> list[tuple[int, float | None]] | None:
    """Each prompt's ``(priority, retention_seconds)`` (None: neither given). Raises
    ``ConfigError`` naming the argument given for another number of prompts."""
    if priorities is None and retention_seconds is None:
        return None
    n = len(prompts)
    for name, values in (("priorities", priorities), ("retention_seconds", retention_seconds)):
        if values is not None and len(values) != n:
            raise ConfigError(name, len(values), f"give one value per prompt ({n}), or none")
    return list(zip(priorities or [0] * n, retention_seconds or [None] * n, strict=True))


def _serve_in_order(
    front: _Front,
    reqs: list[ServingReq],
    scheduler_of: Callable[[ServingReq], Scheduler],
    on_step: StepCallback | None = None,
    broadcast: bool = False,
) -> None:
    """Submit the requests one at a time, each once the one before it is prefilled (no longer
    waiting nor the chunked request of ``scheduler_of(req)``, the scheduler it went to), so each
    sees the tree its predecessors left; then step ``front`` until it is idle. ``on_step`` sees
    every request after every step (their ``output_ids`` so far). ``broadcast``: ``front`` is a
    ``MultiProcessFront``, whose submissions reach the schedulers at the next step's exchange, so
    each submission is followed by one step (the single-process loop steps there too: the
    request is waiting), and every process makes the same calls."""

    def step() -> None:
        front.step()
        if on_step is not None:
            on_step(reqs)

    for req in reqs:
        front.submit([req])
        if broadcast:
            step()
        scheduler = scheduler_of(req)
        while scheduler.waiting or scheduler.chunked is not None:
            step()
    while not front.idle:
        step()


def _checked_prompts(model: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """The prompts as int lists, after ``check_prompts`` and the context check (``ConfigError``)."""
    if max_new_tokens <= 0:
        raise ConfigError("max_new_tokens", max_new_tokens, "must be a positive number of tokens")
    checked = [list(map(int, p)) for p in prompts]
    check_prompts(checked, model.config.vocab_size)
    longest = max(len(p) for p in checked) + max_new_tokens
    if longest > model.spec.context_length:
        raise ConfigError(
            "max_new_tokens",
            max_new_tokens,
            f"the longest prompt plus {max_new_tokens} new tokens is {longest} tokens, more than the model's "
            f"context of {model.spec.context_length}; shorten it",
        )
    return checked


def _config(
    model: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    page_size: int,
    max_total_tokens: int | None,
    chunked_prefill_size: int,
    max_batch_size: int,
    tp_size: int,
    *,
    enable_hierarchical_cache: bool = False,
    dcp_size: int = 1,
    dp_size: int = 1,
    extra_tokens: int = 0,
) -> CacheConfig:
    """The cache of a ``generate`` run: the context rounded up to fit the longest request, a pool
    of ``max_total_tokens`` (default: room for every prompt, its output and ``extra_tokens`` more
    per request, a speculative round's draft tokens past the last kept one, in whole pages of the
    allocator: ``page_size * dcp_size`` tokens under decode context parallelism; ``dp_size``: the
    DP ranks, whose state slots are each a share of the cache's). A model with
    recurrent state under decode context parallelism keeps its checkpoints in the extra buffer
    (``enable_mamba_extra_buffer``: its tree's page is the striped page, ``kvjax.plan.kinds.recurrent``),
    as SGLang's ``auto`` strategy picks ``extra_buffer`` for it."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    context = min(model.spec.context_length, -(-longest // CONTEXT_ROUNDING) * CONTEXT_ROUNDING)
    running = max(2 * max_batch_size, 4)
    extra_buffer = model.spec.uses_ssm_state and dcp_size > 1
    # The state slots default to one per running request; with the extra buffer at least one
    # request's (its slot, two ping-pong slots, checkpoints: kvjax.plan.sizing) per DP rank.
    states = MAMBA_STATES_PER_REQ_WITH_RADIX + MAMBA_EXTRA_BUFFER_STATES[False]
    state_slots = max(running, states) * dp_size if extra_buffer else None
    if max_total_tokens is None:
        striped = page_size * dcp_size  # the allocator's page
        per_request = [-(-(len(p) + max_new_tokens + extra_tokens) // striped) * striped for p in prompts]
        max_total_tokens = max(sum(per_request), 4 * striped)
    return CacheConfig(
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=running,
        context_length=context,
        chunked_prefill_size=chunked_prefill_size,
        enable_hierarchical_cache=enable_hierarchical_cache,
        tp_size=tp_size,
        dcp_size=dcp_size,
        enable_mamba_extra_buffer=extra_buffer,
        max_mamba_cache_size=state_slots,
    )


def _result(reqs: list[ServingReq], stats: ServeStats, speculative: dict | None = None) -> GenerateResult:
    return GenerateResult(
        outputs=[list(r.output_ids) for r in reqs],
        cached_tokens=stats.cached_tokens,
        prompt_tokens=stats.prompt_tokens,
        stats=stats,
        speculative=speculative,
    )


def _summed(per_rank: list[ServeStats]) -> ServeStats:
    """The ranks' statistics added up field by field (counts, seconds, peaks as a sum of the
    ranks' peaks; the per-step histories concatenated in rank order)."""
    total = ServeStats()
    for stats in per_rank:
        for field in dataclasses.fields(ServeStats):
            setattr(total, field.name, getattr(total, field.name) + getattr(stats, field.name))
    return total


def _speculative_config(draft: LoadedModel | NextNDraftModel | None, num_steps: int) -> dict:
    """The ``CacheConfig`` fields of a STANDALONE draft or the target's MTP layer (NEXTN: its pool
    holds the layer after the target's); none without one."""
    if draft is None:
        return {}
    algorithm = draft.algorithm if isinstance(draft, NextNDraftModel) else "STANDALONE"  # NEXTN, or EAGLE (a head)
    return dict(
        speculative_algorithm=algorithm, speculative_num_steps=num_steps, speculative_num_draft_tokens=num_steps + 1
    )


def _draft_spec(draft: LoadedModel | NextNDraftModel | None) -> ModelSpec | None:
    """The draft's spec for ``build_kv_cache``: a STANDALONE draft's own (the MTP layer's pool is
    planned from the target's spec)."""
    return draft.spec if isinstance(draft, LoadedModel) else None


def resolve_draft(
    path: str | None, target: LoadedModel, *, algorithm: str = "STANDALONE", dtype: str | None = None
) -> LoadedModel | NextNDraftModel:
    """The draft of ``--speculative-algorithm``: STANDALONE a separate model (``resolve_model``);
    EAGLE or NEXTN the MTP layer of the checkpoint at ``path`` (the command line passes the
    target's own directory unless the flag names another), with the target's embedding and head
    (``speculative.nextn.load_nextn_draft``: `ConfigError` naming the flag or the value that does
    not fit); EAGLE3 the ``LlamaForCausalLMEagle3`` draft at ``path``
    (``speculative.eagle3_checkpoint.load_eagle3_draft``)."""
    if algorithm == "STANDALONE":
        if path is None:
            raise ConfigError("speculative_draft_model_path", None, "STANDALONE needs a draft model")
        return resolve_model(path, dtype=dtype)
    from kvjax.serve.speculative.nextn import load_nextn_draft

    if path is None:
        raise ConfigError(
            "speculative_draft_model_path", None, f"{algorithm} reads the MTP layer from a checkpoint directory"
        )
    if algorithm == "EAGLE3":
        from kvjax.serve.speculative.eagle3_checkpoint import load_eagle3_draft

        return load_eagle3_draft(path, target)
    return load_nextn_draft(path, target)


def _rank_draft(draft: LoadedModel | NextNDraftModel | None, num_steps: int) -> Any:
    """What every DP rank drafts with (``kvjax.dp.speculative.RankDraft``), or None."""
    if draft is None:
        return None
    from kvjax.dp.speculative import RankDraft

    if isinstance(draft, NextNDraftModel):
        return RankDraft(draft.params, num_steps)
    return RankDraft(draft.params, num_steps, spec=draft.spec, config=draft.config)


def _speculative_counters(scheduler: Scheduler) -> dict | None:
    """A speculative run's counters (``DraftDecoding.report``, EAGLE's too), else None."""
    from kvjax.serve.speculative import DraftDecoding

    proposer = scheduler.proposer
    return proposer.report() if isinstance(proposer, DraftDecoding) else None
