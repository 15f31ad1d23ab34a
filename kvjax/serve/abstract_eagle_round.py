"""The EAGLE (MTP) speculative round's inputs as abstract values: lower and compile
``kvjax.serve.speculative.eagle_steps.make_eagle_round_step`` over a ``("tp",)`` mesh of a TPU
slice that is not here.

``abstract_eagle_round_inputs(spec, config, mesh, batch, num_steps)`` gives the round step's
arguments as ``jax.ShapeDtypeStruct`` leaves with the shardings the round is jitted with:

* ``pools``: what ``build_kv_cache(spec, config, mesh=mesh)`` builds for a ``NEXTN`` config: the
  target's ``kv`` and the MTP layer's ``kv_draft`` (``kvjax.serve.abstract_step.abstract_pools``:
  traced, nothing allocated);
* ``store``: the hidden-state store ``[kv_draft slots, hidden]`` in the target's dtype, replicated
  (as ``EagleDecoding.attach`` allocates it);
* ``params`` / ``draft_params``: the target's and the MTP layer's parameter trees
  (``param_shapes``, ``nextn_param_shapes``) split by ``param_sharding``'s rules: shapes only;
* ``first_tokens`` int32 ``[S]``, ``draft_metas`` (``num_steps + 1`` decode steps stacked, as
  ``proposer.draft_metadata`` packs them) and ``verify_meta`` (``num_steps + 1`` tokens per row,
  every token's logits, as ``verifier.verify_metadata`` packs it), replicated.

The batch (:class:`~kvjax.serve.abstract_step.DecodeBatch`): ``seqs`` rows each ending the round
at ``context`` tokens, so the round starts at committed length ``L = context - num_steps - 1``
and writes positions ``L .. context - 1`` (sequence ``s`` owns pages ``1 + s * pages_per_seq``
onwards, page 0 being the trash page).

:func:`lower_eagle_round` lowers the round for them; ``.compile()`` gives one chip's program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import AttentionMetadata, build_attention_metadata
from kvjax.attention.sharding import serving_mesh
from kvjax.config import CacheConfig
from kvjax.plan import plan_kv_cache
from kvjax.pools import CachePools
from kvjax.serve.abstract_step import DecodeBatch, abstract_pools
from kvjax.serve.model import as_model_config, param_shapes
from kvjax.serve.param_sharding import param_shardings
from kvjax.serve.speculative.eagle_steps import make_eagle_round_step
from kvjax.serve.speculative.nextn import nextn_param_shapes
from kvjax.spec import ModelSpec

__all__ = ["AbstractEagleRoundInputs", "abstract_eagle_round_inputs", "eagle_round_batch", "lower_eagle_round"]


@dataclasses.dataclass(frozen=True)
class AbstractEagleRoundInputs:
    """The round step's arguments as ``ShapeDtypeStruct`` trees with shardings (module docstring)."""

    pools: CachePools
    store: jax.ShapeDtypeStruct
    params: Any
    draft_params: Any
    first_tokens: jax.ShapeDtypeStruct
    draft_metas: AttentionMetadata
    verify_meta: AttentionMetadata

    @property
    def num_steps(self) -> int:
        """``k``: the draft tokens per row (the chain runs the first ``k`` of ``k + 1`` metadata)."""
        return int(self.draft_metas.positions.shape[0]) - 1


def eagle_round_batch(
    batch: DecodeBatch, num_steps: int, page_size: int, pool_tokens: int
) -> tuple[np.ndarray, AttentionMetadata, AttentionMetadata]:
    """``(first_tokens [S], draft_metas, verify_meta)`` of one round of ``batch`` (module
    docstring) as numpy arrays (token ids 0), for a pool of ``pool_tokens`` allocatable slots in
    pages of ``page_size``. ``ValueError`` naming the sizes when ``num_steps < 1``, a row's
    context is shorter than the round (``num_steps + 1`` tokens plus one committed) or the pages
    do not fit."""
    width = num_steps + 1
    if num_steps < 1 or batch.context <= width:
        raise ValueError(f"a round of {num_steps} draft tokens needs num_steps >= 1 and context > {width}")
    pages = batch.pages_per_seq(page_size)
    if batch.seqs * pages * page_size > pool_tokens:
        raise ValueError(
            f"{batch.seqs} sequences of {batch.context} tokens need {batch.seqs * pages * page_size} token slots "
            f"(pages of {page_size}); the pool has {pool_tokens}: raise max_total_tokens or lower seqs/context"
        )
    table = 1 + np.arange(batch.seqs * pages, dtype=np.int32).reshape(batch.seqs, pages)
    committed = batch.context - width
    positions = committed + np.arange(width)
    slots = table[:, positions // page_size] * page_size + positions % page_size  # [S, k + 1]
    kv_len = np.full(batch.seqs, committed, np.int32)
    metas = []
    for j in range(width):
        _, meta = build_attention_metadata(
            tokens=np.zeros(batch.seqs, np.int32),
            starts=kv_len + j,
            slots=slots[:, j],
            page_table=table,
            max_seqs=batch.seqs,
        )
        metas.append(meta)
    draft_metas = jax.tree.map(lambda *leaves: np.stack(leaves), *metas)
    _, verify = build_attention_metadata(
        tokens=[np.zeros(width, np.int32)] * batch.seqs,
        starts=kv_len,
        slots=slots.reshape(-1),
        page_table=table,
        max_seqs=batch.seqs,
    )
    every = np.arange(batch.seqs * width, dtype=np.int32)  # rows are uniform: row s starts at s * width
    verify = dataclasses.replace(verify, logits_indices=every)  # type: ignore[arg-type]  # numpy, as packed
    return np.zeros(batch.seqs, np.int32), draft_metas, verify


def abstract_eagle_round_inputs(
    spec: ModelSpec, config: CacheConfig, mesh: Mesh, batch: DecodeBatch, num_steps: int
) -> AbstractEagleRoundInputs:
    """The round step's arguments for ``batch`` over ``mesh`` (module docstring); ``config`` is
    planned for ``speculative_algorithm="NEXTN"``. Raises ``ValueError`` for a cache without the
    draft pool ``kv_draft`` or with device pools besides it and ``kv``, or a batch the pool cannot
    hold, and the build's own errors (``ConfigError``)."""
    mesh = serving_mesh(mesh)
    if config.platform is None:
        config = config.replace(platform=str(mesh.devices.flat[0].platform))
    plan = plan_kv_cache(spec, config)
    pools = abstract_pools(spec, config, mesh)
    if sorted(pools.names) != ["kv", "kv_draft"]:
        raise ValueError(
            f"{spec.name}'s cache has device pools {list(pools.names)}; the EAGLE round needs 'kv' and 'kv_draft' "
            "(a full-attention or MLA target planned with speculative_algorithm='NEXTN')"
        )
    replicated = NamedSharding(mesh, P())

    def abstract(array: Any) -> jax.ShapeDtypeStruct:
        array = np.asarray(array)
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=replicated)

    first, draft_metas, verify = eagle_round_batch(batch, num_steps, plan.page_size, plan.max_total_tokens)
    model = as_model_config(spec)

    def split(shapes: Any) -> Any:
        return jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            shapes,
            param_shardings(shapes, model, mesh),
        )

    slots = pools["kv_draft"].num_slots
    return AbstractEagleRoundInputs(
        pools=pools,
        store=jax.ShapeDtypeStruct((slots, model.hidden_size), jnp.dtype(model.dtype), sharding=replicated),
        params=split(param_shapes(model)),
        draft_params=split(nextn_param_shapes(model)),
        first_tokens=abstract(first),
        draft_metas=jax.tree.map(abstract, draft_metas),
        verify_meta=jax.tree.map(abstract, verify),
    )


def lower_eagle_round(
    spec: ModelSpec, mesh: Mesh, inputs: AbstractEagleRoundInputs, *, with_logits: bool = False
) -> jax.stages.Lowered:
    """``make_eagle_round_step`` of ``spec`` over ``mesh`` with ``inputs.pools``' layout, lowered
    for ``inputs``: one speculative round as ``EagleDecoding`` jits it, ready to ``.compile()``."""
    round_step = make_eagle_round_step(
        as_model_config(spec), with_logits=with_logits, mesh=serving_mesh(mesh), pools=inputs.pools
    )
    jitted: Any = round_step
    return jitted.trace(
        inputs.pools,
        inputs.store,
        inputs.params,
        inputs.draft_params,
        inputs.first_tokens,
        inputs.draft_metas,
        inputs.verify_meta,
    ).lower()
