"""A toy cache kind defined entirely outside kvjax: a per-request token counter on the device.

It registers once in each layer (``register()``): the planner's ``PlannerKind``, the host side's
(empty) ``HostKind``, the pool builder, the attention and the serving hooks.

* pool ``"token_counter"`` (kind ``"token_counter"``): int32 ``[rows + 1]``, one counter per
  request-table row and a spare entry that padded sequence rows write to; added to the plan by
  the kind (``extra_pools``), built by :func:`create_counter_pool`;
* serving extension :class:`CounterExtension`: each step's metadata part :class:`CounterMetadata`
  (``rows``: the sequences' rows, padding -> the spare entry; ``reset``: 1 for a request's first
  chunk since its admission), read by the model as ``meta.part("token_counter")``;
* model :class:`CounterModel`: adds each sequence's new tokens to its counter (reset first where
  asked) and samples the counter, modulo the vocabulary: a request's first output token is the
  number of prompt tokens it computed, each next one is one more. The tokens therefore read back
  the state the pool carried across chunks and steps;
* attention :func:`count_tokens`, run by ``kvjax.attention.attend`` for the counter's own layer
  ``COUNTER_LAYER``: adds the batch's tokens to the spare entry;
* a plan decision: the planner asks the kind (it applies to the toy model), which refuses the
  decode-side radix cache (``DECODE_RADIX_REFUSAL``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention.kinds import AttentionKind, register_attention_kind
from kvjax.layout.build_context import BuildContext
from kvjax.layout.pool_plan import PoolPlan
from kvjax.plan.kinds import PlannerKind, PoolKind, register_planner_kind
from kvjax.pools.registry import PoolBuilders, register_pool_builders
from kvjax.radix.kinds import HostKind, register_host_kind
from kvjax.serve.extension import ServingExtension, StepBatch
from kvjax.serve.kinds import ServingKind, register_serving_kind

MODEL_NAME = "toy-counter"
KIND_NAME = "token_counter"
POOL_NAME = "token_counter"
VOCAB = 97
COUNTER_LAYER = 1000  # the layer id attend runs the counter for (no model layer has it)
DECODE_RADIX_REFUSAL = (
    "the token counter restarts with each request, so a decode-side radix cache cannot share prefixes; turn it off"
)

POOL = PoolKind(POOL_NAME, "device", "a per-request token counter (toy kind)")


def uses(plan: Any) -> bool:
    return plan.model == MODEL_NAME


def applies(spec: Any, config: Any) -> bool:
    return spec.name == MODEL_NAME


def extra_pools(plan: Any) -> tuple[PoolPlan, ...]:
    rows = int(plan.max_running_requests)
    return (PoolPlan(POOL_NAME, POOL_NAME, (rows + 1,), "int32", 1, (rows + 1) * 4),)


def count_tokens(pool: jax.Array, layer_id: int, q: jax.Array, k: Any, v: Any, meta: Any, **options: Any) -> Any:
    """``attend``'s uniform signature: adds the batch's tokens to the spare entry; returns ``q``."""
    return q, pool.at[-1].add(q.shape[0])


def counter_layers(pool: jax.Array) -> tuple[int, ...]:
    return (COUNTER_LAYER,)


def create_counter_pool(pool: PoolPlan, context: BuildContext) -> jax.Array:
    return jnp.zeros(pool.shape, pool.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CounterMetadata:
    """The toy kind's part of ``AttentionMetadata`` (``meta.part(POOL_NAME)``): int32 ``[S]`` each."""

    FIELD: ClassVar[str] = POOL_NAME

    rows: jax.Array
    reset: jax.Array


class CounterExtension(ServingExtension):
    """Feeds the step the rows to count in and which counters to reset."""

    def __init__(self, cache: Any) -> None:
        self.spare = int(cache.pools[POOL_NAME].shape[0]) - 1
        self.fresh: set[int] = set()  # requests admitted whose first chunk has not run
        self.released: list[tuple[str, bool]] = []

    def after_admit(self, req: Any) -> None:
        self.fresh.add(id(req))

    def step_metadata(self, batch: StepBatch) -> CounterMetadata:
        rows = np.full(batch.max_seqs, self.spare, np.int32)
        rows[: len(batch.rows)] = batch.rows
        reset = np.zeros(batch.max_seqs, np.int32)
        reset[: len(batch.reqs)] = [id(r) in self.fresh for r in batch.reqs]
        make_part: Any = CounterMetadata  # numpy leaves on the host
        return make_part(rows=rows, reset=reset)

    def after_step(self, batch: StepBatch) -> None:
        self.fresh.difference_update(id(r) for r in batch.reqs)

    def before_release(self, req: Any, finished: bool) -> None:
        self.released.append((req.rid, finished))


def serving_extension(cache: Any) -> ServingExtension:
    return CounterExtension(cache)


PLANNER = PlannerKind(
    name=KIND_NAME,
    pool_kinds=(POOL,),
    uses=uses,
    extra_pools=extra_pools,
    page_backup=False,
    applies=applies,
    decode_radix_refusal=DECODE_RADIX_REFUSAL,
)
HOST = HostKind(KIND_NAME)  # the plain allocator, request table and trees
POOLS = PoolBuilders(KIND_NAME, builders={POOL_NAME: create_counter_pool})
ATTENTION = AttentionKind(KIND_NAME, attention=count_tokens, pool=POOL_NAME, layers=counter_layers)
SERVING = ServingKind(KIND_NAME, serving_extension=serving_extension)


def register() -> None:
    """Register the kind in every layer (``kvjax.kinds.unregister_kind(KIND_NAME)`` removes it)."""
    register_planner_kind(PLANNER)
    register_host_kind(HOST)
    register_pool_builders(POOLS)
    register_attention_kind(ATTENTION)
    register_serving_kind(SERVING)


class CounterModel(nn.Module):
    """Counts each sequence's tokens in the pool and samples the count (mod ``VOCAB``)."""

    @nn.compact
    def __call__(self, tokens: jax.Array, pools: Any, meta: Any) -> tuple[jax.Array, Any]:
        counter = pools[POOL_NAME]
        part: CounterMetadata = meta.part(POOL_NAME)
        rows, reset = part.rows, part.reset
        q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
        count = jnp.where(reset > 0, 0, counter[rows]) + q_lens
        counter = counter.at[rows].set(count)
        bias = self.param("bias", nn.initializers.zeros, (VOCAB,), jnp.float32)
        logits = 10.0 * jax.nn.one_hot(count % VOCAB, VOCAB) + bias
        return logits, pools.replace(**{POOL_NAME: counter})


def params() -> dict:
    return {"bias": jnp.zeros(VOCAB, jnp.float32)}
