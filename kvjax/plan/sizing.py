"""Step 3 of the planner: tokens, pages, request rows and recurrent-state slots (pure).

SGLang's sizing (``model_runner_kv_cache_mixin``), with one deliberate difference: every device
array the plan lists fits the budget. SGLang sizes the token pool as ``budget // bytes_per_token``
and then allocates one more page (the trash page) and one more state slot (the padding slot);
kvjax pays for both out of the budget, so ``plan.device_bytes <= plan.kv_budget_bytes`` always.

Rows: SGLang's default ``clamp(tokens / context * 512, 2048, 4096)``, then (kvjax) at most one per
allocatable page, since every running request holds at least one page of its own.

State slots over pipeline stages: each stage with recurrent layers sets its own share aside, and
every stage is given the fewest slots any of them holds (a stage without recurrent layers too: its
request table's state allocator drives every stage), so one slot id is a slot on every stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.plan.kinds.choices import TokenSplit
from kvjax.plan.kinds.planning import kinds_named
from kvjax.plan.records import ModelKind, Sizes, StageLayers, Target
from kvjax.spec import LayerKind, ModelSpec

DEFAULT_MEM_FRACTION_STATIC = 0.9
REQ_TABLE_EXTRA_TOKENS = 4
DEFAULT_MAMBA_CACHE_SIZE = 512
USUAL_PAGE_SIZE = 16  # what a refused page size is told to try instead
MAMBA_STATES_PER_REQ_WITH_RADIX = 3
# Ping-pong tracking slots per request with the extra buffer, keyed by "speculative decoding on":
# kvjax's request table keeps 2 in both (HybridReqToTokenPool), speculative rounds included.
MAMBA_EXTRA_BUFFER_STATES = {False: 2, True: 2}
MIN_ROWS, MAX_ROWS, ROWS_PER_CONTEXT = 2048, 4096, 512


@dataclass(frozen=True)
class _StageBudget:
    """One pipeline stage: its layers, bytes per token, recurrent set-aside and tokens."""

    layers: StageLayers
    bytes_per_token: int
    mamba_bytes_per_req: int
    mamba_slots: int
    mamba_bytes: int
    tokens: int


def kv_budget(config: CacheConfig, device_memory_bytes: int | None) -> int | None:
    """Bytes for KV and recurrent state on one device, or None when only ``max_total_tokens`` sizes the pool."""
    if config.memory_budget_bytes is not None:
        return config.memory_budget_bytes
    if device_memory_bytes is not None:
        if device_memory_bytes <= 0:
            raise ConfigError("device_memory_bytes", device_memory_bytes, "pass the device's memory in bytes (> 0)")
        fraction = config.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
        budget = int(device_memory_bytes * fraction) - config.reserved_memory_bytes
        if budget <= 0:
            raise ConfigError(
                "reserved_memory_bytes",
                config.reserved_memory_bytes,
                f"it leaves nothing of {fraction} x {device_memory_bytes} bytes for the KV cache; lower it",
            )
        return budget
    if config.mem_fraction_static is not None:
        raise ConfigError(
            "mem_fraction_static",
            config.mem_fraction_static,
            "a fraction needs the device memory: pass device_memory_bytes to the planner, or set memory_budget_bytes",
        )
    if config.max_total_tokens is None:
        raise ConfigError(
            "memory_budget_bytes",
            None,
            "size the cache: set {memory_budget_bytes}, {mem_fraction_static} (with device memory) "
            "or {max_total_tokens}",
        )
    return None


def _refuse_empty_pool(config: CacheConfig, budget: int | None, bytes_per_token: int, mamba_bytes: int) -> None:
    """Raise for a pool without one page besides the trash page, naming what to change: the pool
    size when ``max_total_tokens`` sized it; the page size when a usual page (16 tokens) would fit
    the budget; else the budget."""
    ps = config.alloc_page_size
    if budget is None:
        raise ConfigError(
            "max_total_tokens",
            config.max_total_tokens,
            f"the pool holds no whole page of {ps} tokens{_striped(config)}; use {{max_total_tokens}} {ps} or more "
            f"(a multiple of {ps})",
        )
    need = bytes_per_token * 2 * ps + mamba_bytes
    detail = f"{_fmt(bytes_per_token)} bytes/token, {_fmt(mamba_bytes)} bytes of recurrent state"
    usual = min(ps, USUAL_PAGE_SIZE)
    if ps > usual and bytes_per_token * 2 * usual + mamba_bytes <= budget:
        raise ConfigError(
            "page_size",
            config.page_size,
            f"one page of {ps} tokens and the trash page need {_fmt(need)} bytes ({detail}), more than the "
            f"budget of {_fmt(budget)} bytes; use a smaller {{page_size}} such as {usual}",
        )
    raise ConfigError(
        "memory_budget_bytes",
        budget,
        f"the budget holds no page of {ps} tokens besides the trash page ({detail}); give {{memory_budget_bytes}} "
        f"of at least {_fmt(need)} bytes",
    )


def _striped(config: CacheConfig) -> str:
    """`` ({page_size} x {dcp_size} DCP ranks)`` under DCP, else nothing."""
    return (
        f" ({{page_size}} {config.page_size} x {{dcp_size}} {config.dcp_size} DCP ranks)" if config.dcp_enabled else ""
    )


def stage_bounds(num_layers: int, pp_size: int, rank: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of pipeline stage ``rank``: an even split, earlier stages one larger."""
    base, extra = divmod(num_layers, pp_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def stage_layers(spec: ModelSpec, config: CacheConfig, rank: int) -> StageLayers:
    """The layers of stage ``rank`` by pool (asked through ``attention_layer_ids``/``recurrent_layer_ids``)."""
    start, end = stage_bounds(spec.num_hidden_layers, config.pp_size, rank)

    def within(ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i for i in ids if start <= i < end)

    sliding = within(spec.attention_layer_ids(LayerKind.SLIDING))
    full = within(spec.attention_layer_ids(LayerKind.FULL)) + within(spec.attention_layer_ids(LayerKind.MLA))
    if config.disable_hybrid_swa_memory:
        full, sliding = full + sliding, ()
    return StageLayers(start, end, tuple(sorted(full)), sliding, within(spec.recurrent_layer_ids()))


def _common_split(
    split: Callable[..., TokenSplit],
    spec: ModelSpec,
    config: CacheConfig,
    stages: list[StageLayers],
    max_total: int,
    budget: int | None,
    draft_layers: float = 0.0,
) -> TokenSplit:
    """The kind's token split (``PlannerKind.split_tokens``), the same on every pipeline stage, so
    one allocator's slots mean the same on all of them: each stage's own split, then the smallest
    of each part (never more than any stage's own). A stage of sliding layers only is planned as
    part of a hybrid model when another stage has full layers (no request window then). With one
    stage, that stage's split. ``draft_layers``: the draft model's pool in target layers (passed
    to the split only when not 0; every stage's split counts it, the smallest wins)."""
    extra = {"draft_layers": draft_layers} if draft_layers else {}
    parts = [split(spec, config, layers, max_total, budget, **extra) for layers in stages]
    if len(parts) == 1:
        return parts[0]
    hybrid = [p for p, layers in zip(parts, stages, strict=True) if layers.full]
    if not hybrid:
        return parts[0]  # every stage pure sliding: the same split everywhere
    full = min(p.full_tokens_per_layer for p in hybrid)
    swa = min(p.swa_tokens_per_layer for p in parts)
    return replace(
        hybrid[0], full_tokens_per_layer=full, swa_tokens_per_layer=swa, max_total_tokens=full, request_window=None
    )


def _mamba_set_aside(config: CacheConfig, per_req: int, budget: int | None) -> tuple[int, int]:
    """SGLang's ``handle_max_mamba_cache``: (state slots, bytes set aside for recurrent state).

    The bytes include the padding slot (slot 0) the state arrays also hold.
    """
    speculative = config.speculative_algorithm is not None
    spec_bytes = 0
    if speculative and config.speculative_num_draft_tokens and config.max_running_requests:
        spec_bytes = per_req * config.max_running_requests * config.speculative_num_draft_tokens
    if config.disable_radix_cache or config.max_mamba_cache_size is not None or budget is None:
        slots = config.max_mamba_cache_size or config.max_running_requests or DEFAULT_MAMBA_CACHE_SIZE
        if config.enable_dp_attention:
            slots = max(1, slots // config.dp_size)
        return slots, (slots + 1) * per_req + spec_bytes
    rest = budget - spec_bytes
    r = config.mamba_full_memory_ratio
    mamba_mem = max(0, int(rest * r / (1 + r)))
    slots = max(0, mamba_mem // per_req - 1) if per_req else 0
    return slots, mamba_mem + spec_bytes


def _stage_budget(
    config: CacheConfig, target: Target, layers: StageLayers, budget: int | None, draft_bytes_per_token: int = 0
) -> _StageBudget:
    """``draft_bytes_per_token``: the draft model's pool on this stage, sharing its token slots
    (it pays for its trash page too)."""
    per_layer = target.attention_bytes_per_token_per_layer
    bytes_per_token = max(1, layers.kv_layers * per_layer)
    sized_per_token = bytes_per_token + draft_bytes_per_token
    per_req = slots = mamba_bytes = 0
    rest = budget
    if target.recurrent is not None and layers.recurrent:
        per_req = target.recurrent.bytes_per_slot_per_layer * len(layers.recurrent)
        slots, mamba_bytes = _mamba_set_aside(config, per_req, budget)
        rest = None if budget is None else budget - mamba_bytes
    if rest is None:
        tokens = config.max_total_tokens or 0
    else:
        # Every KV pool of the stage also holds one trash page: pay for it first. Under DCP a
        # device holds ``page_size`` rows of each striped page (its trash page's too), and the
        # allocator's slots are ``dcp_size`` times a device's rows (``kvjax.alloc.dcp``).
        trash = config.page_size * sized_per_token if layers.kv_layers else 0
        tokens = max(0, rest - trash) // sized_per_token * config.dcp_size
    return _StageBudget(layers, bytes_per_token, per_req, slots, mamba_bytes, tokens)


def _mamba_states_per_request(config: CacheConfig) -> int:
    if config.disable_radix_cache:
        return 1
    per_req = MAMBA_STATES_PER_REQ_WITH_RADIX
    if config.enable_mamba_extra_buffer:
        per_req += MAMBA_EXTRA_BUFFER_STATES[config.speculative_algorithm is not None]
    return per_req


def req_to_token_width(config: CacheConfig, context_length: int) -> int:
    """Request-table width: ``context + 4 + draft tokens``; with speculation on pages, room for a decode reservation."""
    extra = REQ_TABLE_EXTRA_TOKENS + (config.speculative_num_draft_tokens or 0)
    if config.speculative_algorithm is not None and config.page_size > 1:
        steps = config.speculative_num_steps or 1
        topk = config.speculative_eagle_topk or 1
        per_decode = max(steps * topk, config.speculative_num_draft_tokens or 0)
        extra = max(extra, 2 * per_decode + config.page_size - 1)
    return context_length + extra


def _fmt(n: int) -> str:
    return f"{n:,}"


def decide_sizes(
    spec: ModelSpec,
    config: CacheConfig,
    kind: ModelKind,
    target: Target,
    *,
    device_memory_bytes: int | None,
    draft_bytes_per_token: int = 0,
) -> Sizes:
    """Bytes per token, the token budget of every pipeline stage (the minimum taken, as SGLang
    all-reduces MIN), the SWA split, request rows, the request-table width and state slots.

    ``draft_bytes_per_token``: the draft model's KV per token (``kvjax.plan.draft``), held on the
    last pipeline stage with the same token slots as the target's pool, so counted in that
    stage's budget."""
    warnings: list[str] = []
    ps = config.alloc_page_size
    context_length = config.context_length or spec.context_length
    budget = kv_budget(config, device_memory_bytes)
    last = config.pp_size - 1
    stages = [
        _stage_budget(config, target, stage_layers(spec, config, r), budget, draft_bytes_per_token if r == last else 0)
        for r in range(config.pp_size)
    ]
    stage = stages[config.pp_rank]
    sized = [s for s in stages if s.layers.kv_layers]  # a stage of only recurrent layers holds no tokens
    if not sized:
        raise ConfigError(
            "model",
            spec.name,
            "no layer caches per-token attention (K/V or MLA), so there is no token pool to size; kvjax plans "
            "models with at least one attention layer",
        )
    max_total = min(s.tokens for s in sized)
    if config.max_total_tokens is not None:
        if budget is not None and config.max_total_tokens > max_total:
            warnings.append(
                f"max_total_tokens={config.max_total_tokens} exceeds what the budget holds ({max_total}); "
                f"using {max_total}"
            )
        max_total = min(max_total, config.max_total_tokens) if budget is not None else config.max_total_tokens
    max_total = max_total // ps * ps
    if max_total <= 0:
        _refuse_empty_pool(config, budget, stage.bytes_per_token + draft_bytes_per_token, stage.mamba_bytes)

    full_tokens: int | None = None
    swa_tokens: int | None = None
    request_window: int | None = None
    split = next((k.split_tokens for k in kinds_named(kind.cache_kinds) if k.split_tokens is not None), None)
    if split is not None:  # a kind splits the tokens between its pools (the sliding window)
        # the draft's pool (as many tokens as the allocator's slots) re-split with the budget's tokens
        per_layer = target.attention_bytes_per_token_per_layer
        draft_layers = draft_bytes_per_token / per_layer if budget is not None and per_layer else 0.0
        parts = _common_split(split, spec, config, [s.layers for s in sized], max_total, budget, draft_layers)
        full_tokens, swa_tokens = parts.full_tokens_per_layer, parts.swa_tokens_per_layer
        max_total, request_window = parts.max_total_tokens, parts.request_window
    pages = max_total // ps

    rows = config.max_running_requests
    if rows is None:
        rows = min(max(int(max_total / context_length * ROWS_PER_CONTEXT), MIN_ROWS), MAX_ROWS)
        rows = min(rows, pages)
    elif rows > pages:
        warnings.append(
            f"max_running_requests={rows} exceeds the {pages:,} pages of {ps} tokens; at most {pages:,} requests "
            "can run at once (each holds a page of its own)"
        )
    with_state = [s for s in stages if s.layers.recurrent]
    state_slots: int | None = None
    if target.recurrent is not None and with_state:
        # Every stage runs the same requests with one state allocator (stage 0's): every stage
        # gets the fewest state slots any stage holds, so a slot id is a slot on every stage.
        per_req = _mamba_states_per_request(config)
        slots = state_slots = min(s.mamba_slots for s in with_state)
        if slots // per_req <= 0:
            raise ConfigError(
                "mamba_full_memory_ratio",
                config.mamba_full_memory_ratio,
                f"the budget holds {slots} recurrent-state slots, fewer than the {per_req} one request "
                "needs; raise the memory budget or mamba_full_memory_ratio",
            )
        rows = min(rows, slots // per_req)

    held, need = max_total, min(context_length, request_window or context_length)
    if held < need:
        warnings.append(
            f"the pool holds {held:,} tokens, fewer than one request of context_length={context_length:,}: requests "
            f"are limited to {held - 1:,} tokens (SGLang's max_req_input_len); raise the budget or lower context_length"
        )

    return Sizes(
        page_size=config.page_size,
        alloc_page_size=ps,
        stage=stage.layers,
        bytes_per_token=stage.bytes_per_token,
        kv_budget_bytes=budget,
        max_total_tokens=max_total,
        num_pages=pages,
        full_tokens_per_layer=full_tokens,
        swa_tokens_per_layer=swa_tokens,
        max_mamba_cache_size=(state_slots or 0) if target.recurrent is not None else None,
        mamba_state_bytes_per_req=stage.mamba_bytes_per_req,
        max_running_requests=rows,
        context_length=context_length,
        req_to_token_width=req_to_token_width(config, context_length),
        need_sort=config.need_sort,
        warnings=tuple(warnings),
        draft_bytes_per_token=draft_bytes_per_token if config.pp_rank == last else 0,
        host_bytes_per_token=max(s.bytes_per_token for s in sized),
    )
