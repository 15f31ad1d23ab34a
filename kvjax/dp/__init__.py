"""DP attention: ``dp`` ranks, each with its own tree, allocator, request table and pool slice.

SGLang's DP attention (``enable_dp_attention``) splits the ``tp_size`` chips into ``dp_size``
attention groups of ``attn_tp_size = tp_size / dp_size`` chips. Each group (a DP rank) runs its
own scheduler over its own prefix tree, allocator and request table, and attends only over its
own slice of the KV pools; the MLP/MoE runs over all chips. kvjax lays the ranks out on a mesh
``("data", "tp")``: the pools are built once with a leading rank axis sharded over ``"data"``
and the KV heads over ``"tp"`` (``kvjax.dp.cache``), and attention runs per rank inside
``jax.shard_map`` (``kvjax.dp.attention``); ``kvjax.dp.step`` runs the whole model that way, one
program for every rank. Requests are routed to ranks by ``kvjax.serve.dp_router``;
``kvjax.dp.scheduler`` serves a request stream over ranks with one scheduler per rank, each
stepping on its own; ``kvjax.dp.lockstep`` serves it as DP attention does, one device step for
every rank's batch, each rank's scheduler over a ``kvjax.dp.rank_cache`` view of the shared pools
and its recurrent-state copies written into its own slice (``kvjax.dp.rank_state``);
``kvjax.dp.speculative`` adds speculative decoding (STANDALONE, EAGLE / NEXTN) to lockstep serving.

Modules import jax; the router does not.
"""

from kvjax.dp.attention import dp_attend, stack_rank_inputs
from kvjax.dp.cache import DATA_MESH_AXIS, DPKVCache, DPLayout, DPRank, build_dp_kv_cache
from kvjax.dp.lockstep import LockstepDPScheduler
from kvjax.dp.rank_cache import RankKVCache, rank_caches
from kvjax.dp.rank_state import RankStateCopies
from kvjax.dp.scheduler import DPScheduler
from kvjax.dp.speculative import DPSpeculation, RankDraft, make_dp_paired_prefill_step, make_dp_round_step
from kvjax.dp.step import make_dp_step, place_params

__all__ = [
    "DATA_MESH_AXIS",
    "DPKVCache",
    "DPLayout",
    "DPRank",
    "DPScheduler",
    "DPSpeculation",
    "LockstepDPScheduler",
    "RankKVCache",
    "RankDraft",
    "RankStateCopies",
    "build_dp_kv_cache",
    "dp_attend",
    "make_dp_paired_prefill_step",
    "make_dp_round_step",
    "make_dp_step",
    "rank_caches",
    "place_params",
    "stack_rank_inputs",
]
