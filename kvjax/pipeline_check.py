"""What pipeline parallelism serves, checked before anything is planned or allocated (jax-free).

``check_pipeline_config(spec, config)`` refuses, each with a ``ConfigError`` naming the option, the
value and the change: more stages than layers (``pp_size``); a ``pp_rank`` other than 0 (one
process serves every stage); a STANDALONE draft with stages (SGLang 0.5.23 refuses it: EAGLE
only), an EAGLE3 draft with stages, a draft under DP attention over stages and the host tier
with a draft over stages (not built); and
the host tier for a model with recurrent layers
(its checkpoints' host copies are taken and loaded back by one state engine over stage 0's pools;
one per stage is not built), so the storage tier, which sits behind it, too. DP attention over
stages is built by the lockstep DP front (``kvjax.dp.pipeline``, which refuses more on top of
these).

Recurrent state is served over stages (``kvjax.serve.pipeline_state``): each stage holds its own
recurrent layers' state slots (the planner gives every stage the same number), stage 0's state
allocator drives all, and every state copy the tree records is applied on every stage's pool.

Served over stages (nothing refused here): EAGLE / NEXTN speculative decoding, the draft on the
last stage (``kvjax.serve.pipeline_eagle``); the host tier, each stage copying its own layers with
one host slot id per token on every stage (``kvjax.serve.pipeline_cache``; a host tier sized in
bytes, ``hicache_size``, gets the largest stage's slots on every stage, as SGLang's
``sync_fixed_hicache_size``); the storage tier, one stored page of every stage's layers
(``kvjax.serve.pipeline_storage``); the retraction backup, every stage's pools copied aside and
restored (``kvjax.serve.pipeline_retraction``); and DCP, each stage a ``("tp", "dcp")`` group of
its own (``kvjax.serve.pipeline_cache.pipeline_meshes``).
"""

from __future__ import annotations

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.plan.target import check_pipeline_stages
from kvjax.spec import ModelSpec

__all__ = ["check_pipeline_config"]


def check_pipeline_config(spec: ModelSpec, config: CacheConfig) -> None:
    """Refuse what pipeline parallelism does not serve (module docstring), naming the option and
    the change. Changes nothing."""
    check_pipeline_stages(spec, config.pp_size)
    refusals: tuple[tuple[bool, str, object, str], ...] = (
        (config.pp_rank != 0, "pp_rank", config.pp_rank, "one process serves every stage; leave {pp_rank} 0"),
        (
            config.pp_size > 1 and config.speculative_algorithm == "STANDALONE",
            "speculative_algorithm",
            config.speculative_algorithm,
            "SGLang 0.5.23 serves EAGLE (non-multi-layer) only with pipeline parallelism (validation_hook.py: "
            "check_pipeline_parallel_compat); use 'EAGLE' / 'NEXTN', leave it unset or use {pp_size} 1",
        ),
        (
            config.pp_size > 1 and config.speculative_algorithm == "EAGLE3",
            "speculative_algorithm",
            config.speculative_algorithm,
            "the EAGLE3 draft over several devices is not built in kvjax yet; leave it unset or use {pp_size} 1",
        ),
        (
            config.pp_size > 1 and config.speculative_algorithm is not None and config.enable_dp_attention,
            "speculative_algorithm",
            config.speculative_algorithm,
            "speculative decoding under DP attention over pipeline stages is not built in kvjax yet (the draft is "
            "served over stages of one rank: kvjax.serve.pipeline_eagle); leave it unset, turn "
            "{enable_dp_attention} off or use {pp_size} 1",
        ),
        (
            config.pp_size > 1 and config.speculative_algorithm is not None and config.enable_hierarchical_cache,
            "enable_hierarchical_cache",
            True,
            "the host tier with a draft over pipeline stages is not built in kvjax yet (the draft's host pool "
            "beside the last stage's); leave it off, leave speculative_algorithm unset or use {pp_size} 1",
        ),
        (
            bool(spec.recurrent_layer_ids()) and config.enable_hierarchical_cache and config.pp_size > 1,
            "enable_hierarchical_cache",
            True,
            f"the host copies of {spec.name}'s recurrent-state checkpoints over pipeline stages are not built (one "
            "state engine copies stage 0's pools only); leave it off or use {pp_size} 1",
        ),
    )
    for refused, option, value, fix in refusals:
        if refused:
            raise ConfigError(option, value, fix)
