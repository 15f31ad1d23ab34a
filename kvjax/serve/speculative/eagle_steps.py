"""The jitted steps of EAGLE-style speculative serving (a draft that reads the target's hidden
states: DeepSeek's MTP layer, ``nextn``), each with the pools and the hidden-state store donated.

The hidden-state store ``[num_slots, hidden]`` (the target's dtype) holds, at every KV slot the
target wrote, the target's final-normed hidden state of that token: a function of the token's
prefix, as the KV is, so it is valid wherever the tree serves the slot. A draft step at position
``p`` reads the store at the slot of ``p - 1`` (through the row's page table; zeros at ``p = 0``).

* ``make_eagle_prefill_step``: the target's prefill forward (logits and every token's hidden
  state), the hidden states stored at the tokens' slots, then the draft over the same tokens and
  metadata, each token with the target's hidden state of the position before (the draft's KV
  mirrors the target's prefill into ``"kv_draft"`` at the same slots).
* ``make_eagle_round_step``: one round in one dispatch: the draft's ``k`` chained steps from the
  request's last token ``t`` at position ``L`` (the first with the target's hidden state at
  ``L - 1``, each later one with the draft's own output hidden state: EAGLE's chain), proposing
  ``d_1..d_k``; the target's verify forward over ``[t, d_1..d_k]`` (greedy ``g_0..g_k``, its hidden
  states stored at the round's slots); then the draft again over ``[t, d_1..d_k]`` with the
  target's hidden states, which rewrites the draft's KV at ``L..L + k`` from the target's states
  (SGLang's draft extend after verification): at every accepted position the draft's KV is then
  a function of the prefix, as after a prefill. Returns ``(pools, store, proposals [S, k], greedy
  [S, k + 1][, logits [S, k + 1, vocab]])``.

EAGLE3 (``draft``: an ``Eagle3Config``, ``eagle3_draft``): the target returns its captured layers
``[T, n * hidden]`` instead of its final hidden state, the draft's ``fc`` projects them to ``[T,
hidden]`` and the store keeps that projection; the draft's argmax over its own vocabulary is mapped
to target ids (``d2t``) before it is proposed. The round and the prefill are otherwise the same.

Over a mesh both are jitted with the mesh's shardings: the pools as laid out (donated), both
models' weights split by ``param_sharding``'s rules, the store and everything else replicated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import AttentionMetadata
from kvjax.pools import CachePools
from kvjax.serve.model import build_model, param_shapes
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import param_shardings
from kvjax.serve.speculative.draft_view import draft_view, with_draft
from kvjax.serve.speculative.eagle3_draft import Eagle3Config, LlamaEagle3Draft, eagle3_param_shapes
from kvjax.serve.speculative.nextn import nextn_draft, nextn_param_shapes
from kvjax.serve.speculative.proposer import place_row_tokens
from kvjax.serve.speculative.steps import _layout
from kvjax.serve.speculative.verifier import round_tokens

__all__ = [
    "eagle_prefill_body",
    "eagle_round_body",
    "make_eagle_prefill_step",
    "make_eagle_round_step",
    "previous_hidden",
    "store_hidden",
]


def store_hidden(store: jax.Array, meta: AttentionMetadata, hidden: jax.Array) -> jax.Array:
    """``store`` with every token's ``hidden`` row written at its KV slot (padding: the trash page)."""
    return store.at[meta.out_loc].set(hidden.astype(store.dtype))


def previous_hidden(store: jax.Array, meta: AttentionMetadata, page_size: int) -> jax.Array:
    """``[T, hidden]``: for each token at position ``p`` of its row, the store's row at the slot of
    position ``p - 1`` (the row's page table); zeros at ``p = 0`` and for padding tokens."""
    t = meta.positions.shape[0]
    index = jnp.arange(t, dtype=jnp.int32)
    rows = meta.page_indices.shape[0]
    row = jnp.minimum(jnp.searchsorted(meta.cu_q_lens[1:], index, side="right"), rows - 1)
    before = meta.positions - 1
    pos = jnp.maximum(before, 0)
    slot = meta.page_indices[row, pos // page_size] * page_size + pos % page_size
    live = (before >= 0) & (index < meta.cu_q_lens[meta.num_seqs[0]])
    return jnp.where(live[:, None], store[slot], jnp.zeros((), store.dtype))


def _place_row_hidden(row_hidden: jax.Array, width: int) -> jax.Array:
    """A decode batch's hidden states ``[width, hidden]`` (token ``i`` is row ``i``'s) from one per row."""
    n = min(width, row_hidden.shape[0])
    return jnp.zeros((width, row_hidden.shape[1]), row_hidden.dtype).at[:n].set(row_hidden[:n])


def _jit(
    body: Callable[..., tuple[Any, ...]],
    target_config: ModelConfig,
    outputs: int,
    inputs: int,
    mesh: Mesh | None,
    pool_def: Any,
    pool_leaves: tuple[NamedSharding, ...],
    draft_config: Eagle3Config | None = None,
) -> Any:
    """``body(pools, store, target weights, draft weights, *inputs)`` jitted with the pools and the
    store donated; over ``mesh``: the pools' layout, both models' weights split, the rest replicated."""
    if mesh is None:
        return jax.jit(body, donate_argnums=(0, 1))
    pools = jax.tree.unflatten(pool_def, pool_leaves)
    target = param_shardings(param_shapes(target_config), target_config, mesh)
    if draft_config is None:
        draft = param_shardings(nextn_param_shapes(target_config), target_config, mesh)
    else:
        draft = param_shardings(eagle3_param_shapes(draft_config), draft_config.layer, mesh)
    rep = NamedSharding(mesh, P())
    return jax.jit(
        body,
        in_shardings=(pools, rep, target, draft, *(rep,) * inputs),
        out_shardings=(pools, rep, *(rep,) * outputs),
        donate_argnums=(0, 1),
    )


def _target_with_hidden(config: ModelConfig, draft: Eagle3Config | None = None) -> Any:
    capture = () if draft is None else draft.capture  # EAGLE3: the captured layers
    return build_model(config).clone(return_hidden=True, capture_layers=capture)


def nextn_draft_module(config: ModelConfig, draft: Eagle3Config | None = None) -> Any:
    """The MTP draft module of ``config``, or the EAGLE3 draft of ``draft`` (typed ``Any``: flax's
    ``apply`` returns what ``__call__`` does)."""
    return nextn_draft(config) if draft is None else LlamaEagle3Draft(draft)


def _draft_input(draft: Any, draft_params: Any, hidden: jax.Array, eagle3: bool) -> jax.Array:
    """What the store keeps of the target's hidden states: as they are, or (EAGLE3) projected by
    the draft's ``fc``."""
    return draft.apply({"params": draft_params}, hidden, method="project") if eagle3 else hidden


def _proposed(draft: Any, draft_params: Any, logits: jax.Array, eagle3: bool) -> jax.Array:
    """The draft's greedy tokens as target ids (EAGLE3: its vocabulary's ids mapped by ``d2t``)."""
    ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return draft.apply({"params": draft_params}, ids, method="target_ids") if eagle3 else ids


def _draft_extend(
    draft: Any, draft_params: Any, pools: CachePools, store: jax.Array, tokens: jax.Array, meta: AttentionMetadata
) -> CachePools:
    """The draft over ``tokens`` (each with the target's hidden state of the position before),
    writing its KV at their slots: the draft's pool replaced in ``pools``."""
    page_size = pools["kv_draft"].page_size
    prev = previous_hidden(store, meta, page_size)
    _, _, mirrored = draft.apply({"params": draft_params}, tokens, prev, draft_view(pools), meta)
    return with_draft(pools, mirrored["kv"])


def make_eagle_prefill_step(
    target: ModelConfig,
    *,
    with_logits: bool,
    mesh: Mesh | None = None,
    pools: CachePools | None = None,
    draft: Eagle3Config | None = None,
) -> Any:
    """``prefill(pools, store, params, draft_params, tokens, meta) -> (pools, store, next_tokens[,
    logits])`` (module docstring; ``draft``: an EAGLE3 draft's config), cached per model and layout."""
    return _eagle_prefill(target, with_logits, *_layout(mesh, pools), draft)


@functools.lru_cache(maxsize=8)
def _eagle_prefill(
    target_config: ModelConfig,
    with_logits: bool,
    mesh: Mesh | None = None,
    pool_def: Any = None,
    pool_leaves: tuple[NamedSharding, ...] = (),
    draft: Eagle3Config | None = None,
) -> Any:
    body = eagle_prefill_body(target_config, with_logits=with_logits, draft=draft)
    return _jit(body, target_config, 2 if with_logits else 1, 2, mesh, pool_def, pool_leaves, draft)


def eagle_prefill_body(
    target_config: ModelConfig, *, with_logits: bool, draft: Eagle3Config | None = None
) -> Callable[..., tuple[Any, ...]]:
    """The prefill un-jitted: ``body(pools, store, params, draft_params, tokens, meta) -> (pools,
    store, next_tokens[, logits])`` (module docstring), for a caller that wraps it in a program of
    its own (DP attention's ``shard_map`` over the ranks, ``kvjax.dp.speculative``)."""
    target, module = _target_with_hidden(target_config, draft), nextn_draft_module(target_config, draft)

    def body(
        pools: CachePools, store: jax.Array, params: Any, draft_params: Any, tokens: jax.Array, meta: AttentionMetadata
    ) -> tuple[Any, ...]:
        logits, pools, hidden = target.apply({"params": params}, tokens, pools, meta)
        return after_target_prefill(module, draft_params, pools, store, tokens, meta, logits, hidden, with_logits)

    return body


def after_target_prefill(
    module: Any,
    draft_params: Any,
    pools: CachePools,
    store: jax.Array,
    tokens: jax.Array,
    meta: AttentionMetadata,
    logits: jax.Array,
    hidden: jax.Array,
    with_logits: bool,
) -> tuple[Any, ...]:
    """The prefill after the target's forward (inside jit): ``hidden`` stored at the tokens' slots,
    the draft over ``tokens`` (its KV mirrored), greedy sampling of ``logits``: ``(pools, store,
    next_tokens[, logits])``. ``module``: ``nextn_draft_module``'s (EAGLE3's projects ``hidden``
    first). Shared with the last pipeline stage's prefill (``kvjax.serve.pipeline_eagle``)."""
    eagle3 = isinstance(module, LlamaEagle3Draft)
    store = store_hidden(store, meta, _draft_input(module, draft_params, hidden, eagle3))
    pools = _draft_extend(module, draft_params, pools, store, tokens, meta)
    next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return (pools, store, next_tokens, logits) if with_logits else (pools, store, next_tokens)


def make_eagle_round_step(
    target: ModelConfig,
    *,
    with_logits: bool,
    mesh: Mesh | None = None,
    pools: CachePools | None = None,
    draft: Eagle3Config | None = None,
) -> Any:
    """``round(pools, store, params, draft_params, first_tokens [S], draft_metas, verify_meta)``
    (module docstring; ``draft``: an EAGLE3 draft's config); ``draft_metas`` are
    ``proposer.draft_metadata``'s ``k + 1`` steps, of which the chain runs the first ``k``. Cached
    per model and layout."""
    return _eagle_round(target, with_logits, *_layout(mesh, pools), draft)


@functools.lru_cache(maxsize=8)
def _eagle_round(
    target_config: ModelConfig,
    with_logits: bool,
    mesh: Mesh | None = None,
    pool_def: Any = None,
    pool_leaves: tuple[NamedSharding, ...] = (),
    draft: Eagle3Config | None = None,
) -> Any:
    body = eagle_round_body(target_config, with_logits=with_logits, draft=draft)
    return _jit(body, target_config, 3 if with_logits else 2, 3, mesh, pool_def, pool_leaves, draft)


def eagle_round_body(
    target_config: ModelConfig, *, with_logits: bool, draft: Eagle3Config | None = None
) -> Callable[..., tuple[Any, ...]]:
    """The round un-jitted: ``body(pools, store, params, draft_params, first_tokens, draft_metas,
    verify_meta) -> (pools, store, proposals, greedy[, logits])`` (module docstring), for a caller
    that wraps it in a program of its own (``kvjax.dp.speculative``)."""
    target, module = _target_with_hidden(target_config, draft), nextn_draft_module(target_config, draft)

    def body(
        pools: CachePools,
        store: jax.Array,
        params: Any,
        draft_params: Any,
        first_tokens: jax.Array,
        draft_metas: AttentionMetadata,
        verify_meta: AttentionMetadata,
    ) -> tuple[Any, ...]:
        inputs = (first_tokens, draft_metas, verify_meta)
        pools, proposals, tokens = eagle_chain(module, draft_params, pools, store, *inputs)
        logits, pools, hidden = target.apply({"params": params}, tokens, pools, verify_meta)
        k = proposals.shape[1]
        verified = (tokens, verify_meta, logits, hidden, k, with_logits)
        out = after_target_verify(module, draft_params, pools, store, *verified)
        return (out[0], out[1], proposals, *out[2:])

    return body


def eagle_chain(
    module: Any,
    draft_params: Any,
    pools: CachePools,
    store: jax.Array,
    first_tokens: jax.Array,
    draft_metas: AttentionMetadata,
    verify_meta: AttentionMetadata,
) -> tuple[CachePools, jax.Array, jax.Array]:
    """The draft's ``k`` chained steps of a round (inside jit; module docstring): ``(pools with the
    draft's pool written, proposals [S, k], the verify forward's tokens [T])`` (``T``: ``verify_meta``'s
    token count; the store only read). Shared with the last pipeline stage (``kvjax.serve.pipeline_eagle``)."""
    eagle3 = isinstance(module, LlamaEagle3Draft)
    steps, width = draft_metas.positions.shape
    k = steps - 1
    chain = jax.tree.map(lambda leaf: leaf[:k], draft_metas)
    page_size = pools["kv_draft"].page_size
    first_meta = jax.tree.map(lambda leaf: leaf[0], draft_metas)
    first_hidden = previous_hidden(store, first_meta, page_size)  # the target's at L - 1

    def step(
        carry: tuple[Any, jax.Array, jax.Array], meta: AttentionMetadata
    ) -> tuple[tuple[Any, jax.Array, jax.Array], jax.Array]:
        draft_pool, tokens, hidden = carry
        logits, out, new = module.apply({"params": draft_params}, tokens, hidden, CachePools(kv=draft_pool), meta)
        proposed = _proposed(module, draft_params, logits, eagle3)
        next_hidden = _place_row_hidden(out[meta.logits_indices], width)
        return (new["kv"], place_row_tokens(proposed, width), next_hidden), proposed

    start = (draft_view(pools)["kv"], place_row_tokens(first_tokens, width), first_hidden)
    (draft_pool, _, _), proposals = jax.lax.scan(step, start, chain)
    tokens = round_tokens(first_tokens, proposals, verify_meta.positions.shape[0])
    return with_draft(pools, draft_pool), proposals.T, tokens


def after_target_verify(
    module: Any,
    draft_params: Any,
    pools: CachePools,
    store: jax.Array,
    tokens: jax.Array,
    verify_meta: AttentionMetadata,
    logits: jax.Array,
    hidden: jax.Array,
    k: int,
    with_logits: bool,
) -> tuple[Any, ...]:
    """A round after the target's verify forward over ``tokens`` (inside jit; module docstring):
    its hidden states stored at the round's slots, the draft run again over ``tokens`` with them,
    greedy sampling: ``(pools, store, greedy [S, k + 1][, logits [S, k + 1, vocab]])``. Shared with
    the last pipeline stage (``kvjax.serve.pipeline_eagle``)."""
    eagle3 = isinstance(module, LlamaEagle3Draft)
    store = store_hidden(store, verify_meta, _draft_input(module, draft_params, hidden, eagle3))
    pools = _draft_extend(module, draft_params, pools, store, tokens, verify_meta)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(-1, k + 1)
    out = (pools, store, greedy)
    return (*out, logits.reshape(-1, k + 1, logits.shape[-1])) if with_logits else out
