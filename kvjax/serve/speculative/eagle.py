"""`EagleDecoding`: speculative decoding with a draft that reads the target's hidden states
(SGLang's EAGLE algorithm and its ``NEXTN`` alias, which SGLang maps to EAGLE for DeepSeek's MTP
layer): the draft is the checkpoint's own multi-token-prediction layer (``nextn``).

The scheduler's loop, the round's allocation, acceptance, cut and rollback are `DraftDecoding`'s
(one chain of ``k`` proposals, ``--speculative-eagle-topk 1``, greedy verification); what differs
is the draft's input and its steps (``eagle_steps``): each draft step at position ``p`` consumes the
token there and a hidden state, the target's at ``p - 1`` (kept per KV slot in a hidden-state store
beside the pools) for the round's first step, the draft's own output for the later ones; the
target's verify forward returns its hidden states too, and the draft is run again over the round's
tokens with them, so its KV at every kept position comes from the target's states. Prefill pairs
the draft with the target over each chunk, as STANDALONE does.

EAGLE3 (``speculative_algorithm="EAGLE3"``, a separate ``LlamaForCausalLMEagle3`` draft given
with its ``Eagle3Config``: ``eagle3_draft``, ``eagle3_checkpoint``): the same rounds, the target
capturing three of its layers, the store keeping their projection by the draft's ``fc``, the
draft's proposals mapped from its own vocabulary to the target's. Served on one device (no tensor
parallel mesh, no DP attention yet: refused by name).

Tokens are the target's greedy tokens whatever the draft proposes. The hidden-state store costs
``hidden_size`` values of the target's dtype per KV slot (outside the cache's planned budget); it
is not copied by the host tier, so after a host load-back the draft's first position past the
loaded prefix reads a stale state (fewer tokens accepted there, the same tokens). Nor by the
retraction backup (kvjax's choice): a restored request's draft KV comes back with its target KV
(``kvjax.serve.retraction_extension``), and of the store only the row of its last restored
position is ever read again (by the draft's KV of the next position, written when the prefill
resumes), so carrying the store would cost a copy of ``hidden_size`` values per backed-up token
for one position's proposals; that position's draft KV comes from a stale state (fewer tokens
accepted around it, the same tokens).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.attention.sharding import serving_mesh
from kvjax.build import KVCache
from kvjax.errors import ConfigError
from kvjax.pools import CachePools
from kvjax.serve.model import as_model_config
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import shard_params
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.speculative.draft_decoding import DraftDecoding, SpeculativeStats
from kvjax.serve.speculative.eagle3_checkpoint import EAGLE3_FAMILIES, check_eagle3_fits
from kvjax.serve.speculative.eagle3_draft import Eagle3Config
from kvjax.serve.speculative.eagle_steps import make_eagle_prefill_step, make_eagle_round_step
from kvjax.serve.speculative.nextn import DRAFT_FAMILIES, check_draft_fits, draft_algorithm, draft_layer_ids
from kvjax.spec import ModelSpec

__all__ = ["EAGLE_ALGORITHMS", "EagleDecoding", "eagle_scheduler"]

EAGLE_ALGORITHMS = ("EAGLE", "NEXTN")
"""The ``--speculative-algorithm`` values served by `EagleDecoding` (NEXTN: SGLang's alias)."""


def eagle_scheduler(
    spec: ModelSpec | ModelConfig,
    cache: KVCache,
    params: dict,
    *,
    draft_params: dict,
    num_steps: int,
    topk: int = 1,
    overlap: bool = False,
    eagle3: Eagle3Config | None = None,
    **scheduler_args: Any,
) -> Scheduler:
    """A ``Scheduler`` that decodes speculatively with the target's MTP layer (`EagleDecoding`).

    ``cache``: built with ``CacheConfig(speculative_algorithm="NEXTN", ...)`` (the draft pool holds
    the MTP layer, id ``num_hidden_layers``); ``draft_params``: ``nextn.nextn_params``;
    ``num_steps``: ``k``; ``topk``: 1 (one chain); ``overlap``: rounds overlapped (``overlap.py``);
    ``eagle3``: an EAGLE3 draft's config (the cache built with ``speculative_algorithm="EAGLE3"``,
    ``draft_params`` from ``eagle3_checkpoint.load_eagle3_draft``). The rest as `speculative_scheduler`.
    """
    proposer = EagleDecoding(draft_params, num_steps, topk=topk, eagle3=eagle3)
    proposer.check_cache(spec, cache)
    return Scheduler(as_model_config(spec), cache, params, overlap=overlap, proposer=proposer, **scheduler_args)


class EagleDecoding(DraftDecoding):
    """Proposes ``num_steps`` tokens per request per round with the target's MTP layer (module
    docstring); the ``proposer`` a ``Scheduler`` is given.

    Args:
        draft_params: the MTP layer's weights with the target's embedding and head
            (``nextn.nextn_params``).
        num_steps: ``k`` (SGLang's ``--speculative-num-steps``), >= 1.
        topk: SGLang's ``--speculative-eagle-topk``; only 1 (one chain) is served.
        eagle3: an EAGLE3 draft's config (``draft_params`` its weights), None for an MTP layer or
            an EAGLE head.
    """

    def __init__(
        self, draft_params: dict, num_steps: int, *, topk: int = 1, eagle3: Eagle3Config | None = None
    ) -> None:
        if topk != 1:
            raise ConfigError(
                "speculative_eagle_topk",
                topk,
                "kvjax drafts one chain per request (greedy verification of a chain, no token tree); use 1",
            )
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise ConfigError("speculative_num_steps", num_steps, "give the draft tokens per round, an integer >= 1")
        self.num_steps = num_steps
        self.topk = topk
        self.draft_params = draft_params
        self.draft_config = None  # type: ignore[assignment]  # the draft is built from the target's config
        self.eagle3 = eagle3
        self.stats = SpeculativeStats()
        self.hidden: jax.Array | None = None
        self.replays_state = False
        self.chains = False  # overlap (``DraftDecoding.check_scheduler``)
        self._alloc_end: dict[int, int] = {}
        self._no_prev: tuple[Any, Any] | None = None

    def check_cache(self, spec: ModelSpec | ModelConfig, cache: KVCache) -> None:
        """``ConfigError`` naming what does not fit: a cache without the MTP layer's pool, a target
        family without an MTP layer in kvjax, a draft whose vocabulary or hidden size is not the
        target's."""
        target = as_model_config(spec)
        plan_draft = cache.plan.draft
        if plan_draft is None or "kv_draft" not in cache.pools:
            raise ConfigError(
                "speculative_algorithm",
                None,
                "the cache has no draft pool: build it with CacheConfig(speculative_algorithm='NEXTN', ...)",
            )
        if self.eagle3 is not None:
            self._check_eagle3_cache(target, plan_draft.algorithm, tuple(plan_draft.layer_ids))
            check_eagle3_fits(self.eagle3, self.draft_params)
            return
        if target.family not in DRAFT_FAMILIES:
            raise ConfigError(
                "speculative_algorithm",
                plan_draft.algorithm,
                f"kvjax drafts EAGLE for {list(DRAFT_FAMILIES)} targets (an MTP layer or a Llama EAGLE head), "
                f"not {target.family!r}",
            )
        want, layers = draft_algorithm(target), draft_layer_ids(target)  # MTP: NEXTN; a Llama EAGLE head: EAGLE
        if plan_draft.algorithm != want or tuple(plan_draft.layer_ids) != layers:
            raise ConfigError(
                "speculative_algorithm",
                plan_draft.algorithm,
                f"the EAGLE draft's pool holds layers {list(layers)}; build the cache with "
                f"speculative_algorithm={want!r} (its draft pool holds layers {list(plan_draft.layer_ids)})",
            )
        check_draft_fits(target, self.draft_params)

    def _check_eagle3_cache(self, target: ModelConfig, algorithm: str, layers: tuple[int, ...]) -> None:
        """``ConfigError`` for an EAGLE3 draft over a target family it is not served for, or a cache
        not planned for it (one draft layer, id 0, ``speculative_algorithm="EAGLE3"``)."""
        if target.family not in EAGLE3_FAMILIES:
            raise ConfigError(
                "speculative_algorithm",
                "EAGLE3",
                f"kvjax serves EAGLE3 drafts for {list(EAGLE3_FAMILIES)} targets, not {target.family!r}",
            )
        if algorithm != "EAGLE3" or layers != (0,):
            raise ConfigError(
                "speculative_algorithm",
                algorithm,
                f"the EAGLE3 draft's pool holds layer 0; build the cache with speculative_algorithm='EAGLE3' "
                f"(its draft pool holds layers {list(layers)})",
            )

    def attach(self, scheduler: Scheduler) -> None:
        """Check the scheduler (as `DraftDecoding`), allocate the hidden-state store and compile
        the paired prefill step (the scheduler's step from now on) and the round step."""
        target = self.check_scheduler(scheduler)
        mesh = scheduler.mesh
        if self.eagle3 is not None and mesh is not None:
            raise NotImplementedError(
                "EAGLE3 under tensor parallelism is not served yet (the draft's own vocabulary and 2 * hidden "
                "projections are not split); serve it on one device"
            )
        pools = None
        draft_pool = scheduler.cache.pools["kv_draft"]
        store = jnp.zeros((draft_pool.num_slots, target.hidden_size), jnp.dtype(target.dtype))
        if mesh is not None:  # tensor parallel: the draft's weights split as the target's, the store replicated
            pools = scheduler.cache.pools
            self.draft_params = shard_params(self.draft_params, target, serving_mesh(mesh))
            store = jax.device_put(store, jax.sharding.NamedSharding(serving_mesh(mesh), jax.sharding.PartitionSpec()))
        self.hidden = store
        with_logits = scheduler.record_logits
        draft = self.eagle3
        prefill = make_eagle_prefill_step(target, with_logits=with_logits, mesh=mesh, pools=pools, draft=draft)
        round_step = make_eagle_round_step(target, with_logits=with_logits, mesh=mesh, pools=pools, draft=draft)

        def step(pools: CachePools, params: Any, tokens: Any, meta: Any, *overlap: Any) -> tuple[Any, ...]:
            # ``overlap``: the plain overlap inputs, unread: a prefill's tokens all come from the host
            out = prefill(pools, self.hidden, params, self.draft_params, tokens, meta)
            self.hidden = out[1]
            return (out[0], *out[2:])

        def run_round(pools: CachePools, params: Any, draft_params: Any, *inputs: Any) -> tuple[Any, ...]:
            out = round_step(pools, self.hidden, params, draft_params, *inputs)
            self.hidden = out[1]
            return (out[0], *out[2:])

        scheduler.step_fn = step
        self._round = run_round

    def report(self) -> dict[str, Any]:
        """`DraftDecoding.report` with the algorithm and ``topk``."""
        algorithm = "EAGLE (NEXTN)" if self.eagle3 is None else "EAGLE3"
        return dict(super().report(), algorithm=algorithm, topk=self.topk)
