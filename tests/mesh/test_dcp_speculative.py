"""Speculative decoding under decode context parallelism (DCP) against Transformers (issue 35).

Under DCP (``--tp T --dcp D``: a ``("tp", "dcp")`` mesh of the TP group's ``T`` devices) the draft
model's pool ``kv_draft`` is planned and built as the target's: its pages of ``page_size * D``
allocator slots striped by token over the ``D`` ranks (each device holds its rank's rows of every
page), written and attended through the same DCP attention path (``kvjax.attention.dcp_*``: each
rank's partial attention over its stripe, merged by log-sum-exp). The draft is indexed by the
target's (global, striped) slots, so EAGLE's hidden-state store ``[kv_draft slots, hidden]`` is
laid out by the same slot ids, replicated over the mesh.

* DeepSeek-V2 tiny with a random MTP layer (NEXTN, EAGLE's path) at tp 4 x dcp 2: both MLA
  latent pools striped over ``"dcp"``; tokens equal Transformers' greedy ``generate`` and the
  verify logits agree within 1e-4 through prefix reuse, chunked prefill, eviction, retraction and
  the roll-back of rejected proposals; the store holds Transformers' final-normed hidden state at
  every slot the tree serves for the last chat turn.
* Llama tiny with the target as its own STANDALONE draft at tp 2 x dcp 2 (K/V pools striped, the
  KV heads TP would replicate): every proposal is accepted, so the draft's striped pool follows
  the target's through reuse, chunked prefill, eviction and retraction; tokens and logits as
  Transformers'.
* A Llama EAGLE head at tp 2 x dcp 2 with overlap scheduling: its pool striped as the target's.

Each leaves the cache leak free and the tree sane.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.mesh_check import make_serving_mesh
from kvjax.pools import MHAKVPool, MLAKVPool
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.generate import scheduler_for
from kvjax.serve.speculative import DraftDecoding
from kvjax.serve.speculative.eagle import EagleDecoding, eagle_scheduler
from kvjax.serve.speculative.nextn import nextn_params
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    assert_matches_transformers,
    serve_two_rounds,
    torch,
)
from tests.serve.test_speculative_eagle import LOGIT_ATOL, MAX_NEW, K, nextn_config
from tests.serve.test_speculative_eagle import checkpoints as checkpoints  # noqa: F401, PLC0414  (the fixtures)
from tests.serve.test_speculative_eagle import deepseek as deepseek  # noqa: F401, PLC0414
from tests.serve.test_speculative_parity import family as family  # noqa: F401, PLC0414

pytestmark = pytest.mark.mesh

PAGE = 1  # rows per rank and page: the allocator's page is PAGE * dcp
POOL_TOKENS = 64  # small enough that the two rounds evict and retract


def _assert_both_pools_striped(sched: Any, tp: int, dcp: int, kind: type) -> None:
    """The target's and the draft's pools are striped over ``"dcp"`` on the TP group's devices."""
    assert sched.mesh is not None and dict(sched.mesh.shape) == {"tp": tp // dcp, "dcp": dcp}
    assert sched.alloc.page_size == PAGE * dcp
    for name in ("kv", "kv_draft"):
        pool = sched.cache.pools[name]
        assert isinstance(pool, kind) and pool.context_axis == "dcp", name
        assert len(pool.kv[0].sharding.device_set) == tp, name
        assert {shard.data.shape[1] for shard in pool.kv[0].addressable_shards} == {PAGE}, "a rank's rows only"


def _served(sched: Any) -> dict[str, Any]:
    done = serve_two_rounds(sched, MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    assert sched.leak_free()
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    return done


def test_deepseek_v2_mtp_layer_at_tp4_dcp2(deepseek):
    hf, _, directory, _ = deepseek
    model = load_checkpoint(directory)
    tp, dcp = 4, 2
    mesh = make_serving_mesh(tp, dcp_size=dcp, devices=jax.devices())
    config = nextn_config(page_size=PAGE, max_total_tokens=POOL_TOKENS, tp_size=tp, dcp_size=dcp)
    sched = eagle_scheduler(
        model.config,
        build_kv_cache(model.spec, config, mesh=mesh),
        model.params,
        draft_params=nextn_params(model.config, model.params, directory),
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    assert isinstance(sched.proposer, EagleDecoding)
    _assert_both_pools_striped(sched, tp, dcp, MLAKVPool)
    done = _served(sched)
    assert sched.proposer.stats.rounds > 0 and sched.proposer.stats.rolled_back_slots > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    # the store, indexed by the striped slots, holds the target's final-normed hidden state there
    req = done["chat2"]
    tokens = list(req.origin_input_ids) + req.output_ids[:-1]
    slots = np.asarray(sched.cache.tree_cache.match_prefix(tokens).indices)
    assert len(slots) > 0
    with torch.no_grad():
        want = hf.model(torch.tensor([tokens])).last_hidden_state[0, : len(slots)].numpy()
    np.testing.assert_allclose(np.asarray(sched.proposer.hidden)[slots], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_llama_standalone_draft_at_tp2_dcp2_accepts_every_proposal(family):
    _, hf, target, _, target_dir = family
    same = load_checkpoint(target_dir)  # the target as its own draft
    tp, dcp = 2, 2
    mesh = make_serving_mesh(tp, dcp_size=dcp, devices=jax.devices())
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=PAGE,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        speculative_algorithm="STANDALONE",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        tp_size=tp,
        dcp_size=dcp,
    )
    cache = build_kv_cache(target.spec, config, draft_spec=same.spec, mesh=mesh)
    sched = scheduler_for(
        target, cache, draft=same, num_steps=K, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    assert isinstance(sched.proposer, DraftDecoding)
    _assert_both_pools_striped(sched, tp, dcp, MHAKVPool)
    done = _served(sched)
    assert sched.proposer.stats.acceptance_rate == 1.0, (
        f"a draft row did not follow the target's: {sched.proposer.stats}"
    )
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_llama_eagle_head_at_tp2_dcp2(tmp_path_factory):
    """A Llama EAGLE head (SGLang's ``LlamaForCausalLMEagle``) at tp 2 x dcp 2, overlap on: its
    pool striped as the target's, its rounds chained on the device; Transformers' tokens and logits
    through reuse, chunked prefill, eviction and retraction."""
    from kvjax.serve.speculative.nextn import load_nextn_draft
    from tests.serve.test_eagle_head import _checkpoints

    hf, target_dir, head_dir = _checkpoints(str(tmp_path_factory.mktemp("eagle_head")))
    model = load_checkpoint(target_dir)
    tp, dcp = 2, 2
    mesh = make_serving_mesh(tp, dcp_size=dcp, devices=jax.devices())
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=PAGE,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        speculative_algorithm="EAGLE",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        tp_size=tp,
        dcp_size=dcp,
    )
    sched = eagle_scheduler(
        model.config,
        build_kv_cache(model.spec, config, mesh=mesh),
        model.params,
        draft_params=load_nextn_draft(head_dir, model).params,
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        overlap=True,
    )
    assert isinstance(sched.proposer, EagleDecoding)
    _assert_both_pools_striped(sched, tp, dcp, MHAKVPool)
    done = _served(sched)
    assert sched.proposer.stats.overlapped_rounds > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
