"""Greedy generation through the whole stack: plan, build, radix cache, scheduler.

``resolve_model`` turns ``--model`` into a `LoadedModel` (a checkpoint directory, or a small
preset with random weights). ``generate`` serves several prompts as one workload on one cache:
prompt ``i + 1`` arrives once prompt ``i`` has been prefilled (its prompt is then in the radix
tree), so later prompts reuse the prefixes of earlier ones while all of them decode together.

Every check happens before the cache is built: prompts must be non-empty, their ids inside the
vocabulary, and prompt plus output inside the model's context; each failure is a `ConfigError`
naming the prompt, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from kvjax.build import build_kv_cache
from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint
from kvjax.serve.model import init_params, param_shapes
from kvjax.serve.model_config import ModelConfig, model_config_from_spec
from kvjax.serve.model_fingerprint import random_weights_fingerprint
from kvjax.serve.scheduler import Scheduler, ServeStats, ServingReq
from kvjax.serve.tp_mesh import tp_mesh
from kvjax.spec import ModelSpec

MAX_RANDOM_PARAMS = 200_000_000  # presets get random weights; beyond this, ask for a checkpoint
CONTEXT_ROUNDING = 64  # context (and so the page table) rounded up to this many tokens: fewer compiles


@dataclasses.dataclass
class GenerateResult:
    """Outputs in prompt order, and what the cache did (token counts over all prompts)."""

    outputs: list[list[int]]
    cached_tokens: int
    prompt_tokens: int
    stats: ServeStats

    def to_dict(self) -> dict:
        return {"outputs": self.outputs, "cached_tokens": self.cached_tokens, "prompt_tokens": self.prompt_tokens}


def resolve_model(model: str, *, dtype: str | None = None) -> LoadedModel:
    """A checkpoint directory, or a preset name (random weights from seed 0, small presets only)."""
    path = Path(model)
    if path.is_dir():
        return load_checkpoint(path, dtype=dtype)
    if model not in ModelSpec.presets():
        raise ConfigError(
            "model",
            model,
            f"is neither a checkpoint directory nor a preset; pass a directory with config.json and "
            f"*.safetensors, or one of {list(ModelSpec.presets())}",
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
    dcp_size: int = 1,
) -> tuple[GenerateResult, Scheduler]:
    """Greedy-generate up to ``max_new_tokens`` per prompt (see the module docstring).

    ``max_total_tokens``: KV pool size in tokens (default: room for every prompt and output, so
    nothing is evicted; make it small to force eviction and retraction). ``stop_token_ids``:
    default the model's end-of-sequence ids; ``()`` to always generate ``max_new_tokens``.
    ``enable_hierarchical_cache``: add the host tier (evicted prefixes kept in host memory).
    ``overlap``: overlap scheduling (``Scheduler``'s; False: each step runs to completion first).
    ``tp_size``: tensor parallelism over the first ``tp_size`` local devices (``tp_mesh``);
    ``dcp_size``: each request's KV striped over that many times as many (``tp_mesh``).
    Returns the result and the scheduler (its cache, tree and stats) for inspection.
    """
    if max_new_tokens <= 0:
        raise ConfigError("max_new_tokens", max_new_tokens, "must be a positive number of tokens")
    prompts = [list(map(int, p)) for p in prompts]
    check_prompts(prompts, model.config.vocab_size)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > model.spec.context_length:
        raise ConfigError(
            "max_new_tokens",
            max_new_tokens,
            f"the longest prompt plus {max_new_tokens} new tokens is {longest} tokens, more than the model's "
            f"context of {model.spec.context_length}; shorten it",
        )
    context = min(model.spec.context_length, -(-longest // CONTEXT_ROUNDING) * CONTEXT_ROUNDING)
    if max_total_tokens is None:
        striped = page_size * dcp_size  # the allocator's page
        per_request = [-(-(len(p) + max_new_tokens) // striped) * striped for p in prompts]
        max_total_tokens = max(sum(per_request), 4 * striped)
    config = CacheConfig(
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=max(2 * max_batch_size, 4),
        context_length=context,
        chunked_prefill_size=chunked_prefill_size,
        enable_hierarchical_cache=enable_hierarchical_cache,
        tp_size=tp_size,
        dcp_size=dcp_size,
    )
    cache = build_kv_cache(model.spec, config, mesh=tp_mesh(tp_size, dcp_size))
    scheduler = Scheduler(
        model.config,
        cache,
        model.params,
        max_batch_size=max_batch_size,
        chunked_prefill_size=chunked_prefill_size,
        record_logits=record_logits,
        overlap=overlap,
    )
    stops = model.stop_token_ids if stop_token_ids is None else tuple(stop_token_ids)
    reqs = [ServingReq(i, p, max_new_tokens=max_new_tokens, stop_token_ids=stops) for i, p in enumerate(prompts)]
    for req in reqs:
        scheduler.submit([req])
        while scheduler.waiting or scheduler.chunked is not None:
            scheduler.step()
    while not scheduler.idle:
        scheduler.step()
    stats = scheduler.stats
    result = GenerateResult(
        outputs=[list(r.output_ids) for r in reqs],
        cached_tokens=stats.cached_tokens,
        prompt_tokens=stats.prompt_tokens,
        stats=stats,
    )
    return result, scheduler
