"""DP attention with decode context parallelism on 8 CPU devices gives Transformers' tokens.

``--dp 2 --tp 8 --dcp 2`` (SGLang: DCP divides each DP rank's attention TP group): a ``("data",
"tp", "dcp")`` mesh of 2 x 2 x 2 devices; each DP rank is a group of 4 chips with its own tree,
allocator and request table, its pools' KV heads over its 2 ``"tp"`` devices and its tokens
striped over its 2 ``"dcp"`` devices (the allocator's page is ``page_size * 2``), its weights and
query heads over all 4. The tiny DeepSeek-V2 (its MLA latent, which TP replicates, striped) and
the tiny Llama (2 KV heads over ``"tp"``, tokens striped over ``"dcp"``) are served by
``LockstepDPScheduler`` through the two rounds of ``parity_harness`` (cache-aware routing, every
rank's balance checked after every round, ``tests.mesh.dp_balance``) on pools small enough that
prefixes are reused, prompts prefill in chunks, the trees evict and the schedulers retract (each
asserted); tokens equal Transformers' greedy ``generate`` and logits agree within 1e-4; both ranks
serve and end leak free. ``generate --dp 2 --tp 8 --dcp 2`` gives the one-device tokens, and a
``--dcp`` that does not divide a rank's ``--tp / --dp`` chips is one error line naming the flags.
"""

from __future__ import annotations

import jax
import pytest

from kvjax import CacheConfig
from kvjax.cli import main
from kvjax.dp import LockstepDPScheduler
from kvjax.mesh_check import make_serving_mesh
from kvjax.pools import MHAKVPool, MLAKVPool
from tests.mesh.dp_balance import BalancedFront
from tests.mesh.tp_serving import family_checkpoint
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers, serve_two_rounds

DP, TP, DCP = 2, 8, 2
MAX_NEW = 6
ATOL = 1e-4
PAGE = 1
POOL_TOKENS = 48  # per rank, striped slots: small enough to evict and retract on a rank


@pytest.mark.parametrize("family", ["deepseek_v2", "llama"])
def test_reuse_chunked_prefill_eviction_and_retraction(family, tmp_path_factory):
    hf, model = family_checkpoint(family, tmp_path_factory)
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=PAGE,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        tp_size=TP,
        dp_size=DP,
        enable_dp_attention=True,
        dcp_size=DCP,
    )
    mesh = make_serving_mesh(TP, DP, True, devices=jax.devices(), dcp_size=DCP)
    assert dict(mesh.shape) == {"data": DP, "tp": TP // DP // DCP, "dcp": DCP}
    front = LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        mesh,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
    )
    done = serve_two_rounds(BalancedFront(front), MAX_NEW)  # type: ignore[arg-type]

    kv = front.cache.pools.kv
    assert isinstance(kv, MLAKVPool if family == "deepseek_v2" else MHAKVPool)
    for layer in kv.kv:  # a slice per rank, its striped page rows split over "dcp" (one device's: PAGE rows)
        assert len(layer.sharding.device_set) == TP and layer.shape[:1] + layer.shape[2:3] == (DP, PAGE * DCP)
        assert {shard.data.shape[:1] + shard.data.shape[2:3] for shard in layer.addressable_shards} == {(1, PAGE)}
    rank_view = jax.tree_util.tree_unflatten(front.cache.layout.rank_pools, jax.tree.leaves(front.cache.pools))
    assert rank_view.kv.context_axis == "dcp", "each rank's pools attend through DCP attention"
    assert all(s.page_size == PAGE * DCP for s in front.schedulers)
    assert sorted(set(front.rank_of.values())) == [0, 1], front.rank_of
    assert [s.leak_free() for s in front.schedulers] == [True, True]
    stats = [s.stats for s in front.schedulers]
    assert sum(st.cached_tokens for st in stats) > 0, stats
    assert sum(st.evicted_tokens for st in stats) > 0, stats
    assert sum(st.retractions for st in stats) > 0, stats
    assert sum(st.prefill_steps for st in stats) > len(done), "prompts longer than a chunk prefill in chunks"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_generate_gives_the_one_device_tokens_and_names_the_flags(capsys):
    argv = ["generate", "--model", "deepseek-tiny", "--prompt-ids", "1,2,3,4,5,6,7,8,9", "--prompt-ids", "1,2,3,4,5"]
    argv += ["--max-new-tokens", "4", "--page-size", "2", "--json"]
    assert main(argv) == 0
    one_device = capsys.readouterr().out
    assert main([*argv, "--dp", "2", "--tp", "8", "--dcp", "2"]) == 0
    assert capsys.readouterr().out == one_device
    assert main([*argv, "--dp", "2", "--tp", "4", "--dcp", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--dcp 4" in err and "--tp 4 / --dp 2 = 2 chips" in err, err
