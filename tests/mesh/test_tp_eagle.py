"""EAGLE-style speculative decoding (DeepSeek's MTP layer) under tensor parallelism, against
Hugging Face Transformers (issue 35).

The tiny DeepSeek-V2 target of ``tests/serve/test_speculative_eagle.py`` with its MTP layer (random
weights added to the checkpoint) is served at tp 2: the target's and the MTP layer's weights split
Megatron style (query heads and ``kv_b_proj`` over ``"tp"``, the latent projection replicated),
the latent pools (``kv`` and ``kv_draft``) replicated over the mesh, the hidden-state store
replicated, both steps jitted with the mesh's shardings and the pools donated. Tokens equal
Transformers' greedy ``generate`` and the target's verify logits agree within 1e-4, through prefix
reuse, a multi-turn chat and chunked prefill (page 16); the bigram target with the MTP layer made
to agree accepts every proposal over the mesh too.
"""

from __future__ import annotations

from typing import Any

import jax
import pytest

from kvjax import build_kv_cache
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.speculative.eagle import EagleDecoding, eagle_scheduler
from kvjax.serve.speculative.nextn import nextn_params
from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve.parity_harness import CHUNK, assert_matches_transformers, serve_two_rounds
from tests.serve.test_speculative_eagle import LOGIT_ATOL, MAX_NEW, K, nextn_config
from tests.serve.test_speculative_eagle import bigram as bigram  # noqa: F401, PLC0414  (the fixtures)
from tests.serve.test_speculative_eagle import checkpoints as checkpoints  # noqa: F401, PLC0414
from tests.serve.test_speculative_eagle import deepseek as deepseek  # noqa: F401, PLC0414

pytestmark = pytest.mark.mesh


def _serve(directory: Any, tp: int, *, page_size: int, max_total_tokens: int) -> Any:
    model = load_checkpoint(directory)
    config = nextn_config(page_size=page_size, max_total_tokens=max_total_tokens, tp_size=tp)
    cache = build_kv_cache(model.spec, config, mesh=mesh_of(tp))
    sched = eagle_scheduler(
        model.config,
        cache,
        model.params,
        draft_params=nextn_params(model.config, model.params, directory),
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    assert isinstance(sched.proposer, EagleDecoding)
    assert_sharded(sched, tp)
    draft_weights = jax.tree.leaves(sched.proposer.draft_params)
    assert any(not a.sharding.is_fully_replicated for a in draft_weights), "the MTP layer's heads should be split"
    done = serve_two_rounds(sched, MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    assert sched.leak_free()
    return sched, done


def test_tp2_page_16_reuse_multi_turn_chunked(deepseek):
    hf, _, directory, _ = deepseek
    sched, done = _serve(directory, 2, page_size=16, max_total_tokens=2048)
    assert sched.stats.cached_tokens > 0 and sched.proposer.stats.rounds > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_tp2_a_draft_made_to_agree_is_accepted(bigram):
    hf, directory = bigram
    sched, done = _serve(directory, 2, page_size=16, max_total_tokens=2048)
    assert sched.proposer.stats.acceptance_rate >= 0.9, sched.proposer.stats
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
