"""How the scheduler runs a batch on the devices: the `Stepping` it is given, and `OneMesh`.

The scheduler (``kvjax.serve.scheduler``) decides what runs (admission, decode, retraction, the
tree); a ``Stepping`` decides where and how: it lays the device state and the weights out, packs
the batch for its step shapes, launches the jitted step(s) with the pools donated and hands the
new pools to the scheduler's one writer of device state (``Scheduler.store_pools``). The
variants are objects the scheduler is given, not subclasses of it:

* ``OneMesh`` (the default): one step over one device or one tensor-parallel mesh
  (``kvjax.serve.step``);
* ``PipelineStages`` (``kvjax.serve.pipeline_stepping``): the layers split into stages, each on
  its own devices, the batch in micro-batches;
* ``LockstepRank`` (``kvjax.dp.lockstep``): one DP rank of lockstep DP attention, whose batch
  joins the other ranks' in one DP step.

Every variant packs its rows with ``Scheduler.pack`` (the extensions' metadata parts, the
overlap's future-token sources) and closes the step with ``Scheduler.after_forward`` (the early
token copy, the extensions' ``after_step``, the timing), so the shared part is written once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from kvjax.attention import AttentionMetadata
from kvjax.attention.sharding import pools_mesh
from kvjax.device_state import DeviceState
from kvjax.serve.extension import StepBatch
from kvjax.serve.step import StepFn, make_module_step, make_sharded_step, make_step, place_on_mesh

if TYPE_CHECKING:
    from kvjax.attention import MetadataBuilder
    from kvjax.build import KVCache
    from kvjax.serve.model_config import ModelConfig
    from kvjax.serve.serving_req import ServingReq
    from kvjax.spec import ModelSpec

__all__ = ["OneMesh", "PackedStep", "Proposer", "StepOwner", "Stepping", "StepRows"]


@dataclasses.dataclass(frozen=True)
class StepRows:
    """The rows of one step as the scheduler formed them (host arrays).

    ``tokens``: per row its new input ids (prefill: a list of arrays; decode: one id per row);
    ``starts``: tokens of each row already in the cache; ``slots``: the KV slots of every new
    token, row after row; ``rows``: each row's request-table row; ``seq_lens``: each row's length
    after the step; ``reqs``: the requests; ``token_src`` (overlap, decode): per row the row of
    the in-flight step's output holding its input id, or -1 for the host's ``tokens``;
    ``page_table``: the rows' padded page table when the scheduler knows it is unchanged since
    the step it was built for, else None.
    """

    tokens: list[np.ndarray] | np.ndarray
    starts: np.ndarray
    slots: np.ndarray
    rows: np.ndarray
    seq_lens: np.ndarray
    reqs: Sequence[ServingReq]
    token_src: np.ndarray | None = None
    page_table: np.ndarray | None = None

    @property
    def is_decode(self) -> bool:
        return isinstance(self.tokens, np.ndarray)


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """One step's (or micro-batch's) device inputs, packed on the host: the flat ``tokens``, the
    ``meta`` (``AttentionMetadata``), the overlap's ``token_src`` (int32 per token, -1: the host's
    id; None without overlap) and the ``batch`` the extensions saw (None without extensions)."""

    tokens: np.ndarray
    meta: AttentionMetadata
    token_src: np.ndarray | None
    batch: StepBatch | None


class StepOwner(Protocol):
    """What a stepping reads and calls of the scheduler it steps for (``Scheduler`` is one): the
    cache and weights, the step's settings, the packing and closing of a step and the one writer
    of device state. Declared here so that this module needs nothing of the scheduler's."""

    cache: KVCache
    params: Any
    model_config: ModelConfig | None
    record_logits: bool
    overlap: bool
    metadata: MetadataBuilder
    no_tokens: jax.Array
    step_page_table: np.ndarray | None
    rows: Any
    page_size: int

    def pack(
        self, builder: MetadataBuilder, step: StepRows, a: int, b: int, *, page_table: np.ndarray | None = None
    ) -> PackedStep: ...

    def previous_tokens(self, first: jax.Array) -> jax.Array: ...

    def store_pools(self, pools: Any, stage: int = 0) -> None: ...

    def after_forward(
        self, packed: Sequence[PackedStep], next_tokens: jax.Array, start: float, launched: float, end: float
    ) -> None: ...


class Stepping(Protocol):
    """How a batch is stepped (module docstring). ``mesh``: the devices the first step's inputs
    live on (None: the default device); ``states``: the device state of each group it steps
    (one per pipeline stage; one otherwise), what ``Scheduler.store_pools`` writes. A stepping
    belongs to one scheduler (``setup`` binds it): give each scheduler its own."""

    mesh: Mesh | None

    @property
    def states(self) -> tuple[DeviceState, ...]: ...

    def setup(self, scheduler: StepOwner, spec: ModelSpec | ModelConfig, model: Any) -> None:
        """Lay ``scheduler``'s device state and weights out and compile the step(s); set ``mesh``."""
        ...

    def forward(self, scheduler: StepOwner, step: StepRows) -> tuple[jax.Array, jax.Array | None]:
        """Run ``step`` and store the new pools; the sampled tokens (``[max_seqs]``, on the device)
        and, with ``record_logits``, the logits."""
        ...


class Proposer(Protocol):
    """How decode tokens are proposed, when not one per request per step (the scheduler's
    default): the scheduler admits, prefills, evicts, retracts and caches as always, and hands
    each decode step to its proposer (``DraftDecoding``, ``kvjax.serve.speculative``). Its methods
    take the ``Scheduler`` itself (typed ``Any`` here: a proposer reads the scheduler's running
    batch, allocator and finishing, more than ``StepOwner`` says)."""

    def attach(self, scheduler: Any) -> None:
        """Check ``scheduler`` can decode this way (refusing by name what it cannot) and compile
        what it needs; may replace the prefill step (``scheduler.step_fn``)."""
        ...

    def check_servable(self, scheduler: Any, reqs: Sequence[ServingReq]) -> None:
        """``ConfigError`` for a request this way of decoding can never serve (after the plain checks)."""
        ...

    def decode(self, scheduler: Any, done: list[ServingReq]) -> None:
        """One decode step of ``scheduler.running``: allocate, run, store the pools
        (``Scheduler.store_pools``), settle and finish (appending to ``done``)."""
        ...


class OneMesh:
    """One jitted step over the cache's own devices: one device, or the mesh its pools are
    sharded over (tensor parallelism: pools and weights laid out over it and the step jitted with
    their shardings, ``kvjax.serve.step.make_sharded_step``).

    ``step_fn``: the compiled step ``(pools, params, tokens, meta[, prev_tokens, token_src]) ->
    (pools, next_tokens[, logits])``; given, it is used as it is (nothing is laid out), else
    ``setup`` builds the model's.
    """

    def __init__(self, step_fn: StepFn | None = None) -> None:
        self.step_fn: StepFn | None = step_fn
        self.mesh: Mesh | None = None
        self._state: DeviceState | None = None

    @property
    def states(self) -> tuple[DeviceState, ...]:
        if self._state is None:
            raise RuntimeError("OneMesh: set up by a Scheduler first")
        return (self._state,)

    def setup(self, scheduler: StepOwner, spec: ModelSpec | ModelConfig, model: Any) -> None:
        cache, with_logits = scheduler.cache, scheduler.record_logits
        self._state = cache.state
        self.mesh = pools_mesh(cache.pools)
        if self.step_fn is not None:
            return
        if self.mesh is None:
            config = scheduler.model_config
            self.step_fn = (
                make_step(config, with_logits=with_logits)
                if config is not None
                else make_module_step(model, with_logits=with_logits)
            )
            return
        pools, scheduler.params = place_on_mesh(scheduler.model_config, cache.pools, scheduler.params, self.mesh)
        scheduler.store_pools(pools)
        self.step_fn = make_sharded_step(
            scheduler.model_config or spec,
            self.mesh,
            pools,
            with_logits=with_logits,
            module=model,
            params=scheduler.params,
        )

    def forward(self, scheduler: StepOwner, step: StepRows) -> tuple[jax.Array, jax.Array | None]:
        """Pack ``step`` whole, apply the pending device updates, launch the step with the pools
        donated and store its pools. The page table the step reads is left in
        ``scheduler.step_page_table`` (reused by the next decode step when unchanged)."""
        start = time.perf_counter()
        packed = scheduler.pack(scheduler.metadata, step, 0, len(step.rows), page_table=step.page_table)
        scheduler.step_page_table = np.asarray(packed.meta.page_indices)  # numpy: built on the host
        inputs: tuple[Any, ...] = (packed.tokens, packed.meta)
        if scheduler.overlap:
            inputs += (scheduler.previous_tokens(scheduler.no_tokens), packed.token_src)
        launched = time.perf_counter()
        # Loads, restores and forks recorded since the last step land before this step reads them.
        pools = scheduler.cache.apply_pending()
        out = self.launch(scheduler, pools, inputs)
        end = time.perf_counter()
        scheduler.store_pools(out[0])  # host bookkeeping: counted outside the step's time
        scheduler.after_forward([packed], out[1], start, launched, end)
        return out[1], (out[2] if scheduler.record_logits else None)

    def launch(self, scheduler: StepOwner, pools: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """Run the compiled step on ``pools`` (donated) and the packed ``inputs``:
        ``(new pools, next_tokens[, logits])``."""
        assert self.step_fn is not None, "OneMesh: set up by a Scheduler first"
        return self.step_fn(pools, scheduler.params, *inputs)
