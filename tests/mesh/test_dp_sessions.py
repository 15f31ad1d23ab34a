"""Sessions under DP attention (issue 37): ``LockstepDPScheduler`` at dp 2 x tp 2 on 8 CPU devices.

Four sessions of six turns each over two DP ranks: every session's turns go to the rank its first
turn was routed to, each turn after the first prefills only its new tokens and the previous turn's
last output token (the rank holds the rest), tokens and logits equal Transformers' greedy
``generate`` on the whole conversation, and both ranks end leak free once the sessions are closed.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from kvjax import CacheConfig
from kvjax.dp import LockstepDPScheduler
from kvjax.serve.scheduler import ServingReq
from tests.serve.parity_harness import TINY_CONFIG, assert_matches_transformers, tiny_checkpoint, transformers
from tests.serve.random_workloads import TINY_LAYER_SIZES

DP, TP = 2, 2
SESSIONS, TURNS, NEW, OUT = 4, 6, 3, 2


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_lockstep_dp_sessions_stick_to_their_rank_and_prefill_only_each_new_turn(tmp_path_factory, policy):
    config_hf = transformers.LlamaConfig(**dict(TINY_CONFIG, **TINY_LAYER_SIZES, num_hidden_layers=2))
    hf, model = tiny_checkpoint(config_hf, tmp_path_factory, f"dp-session-{policy}", seed=1)
    config = CacheConfig(
        context_length=128,
        chunked_prefill_size=16,
        page_size=4,
        max_total_tokens=256,
        max_running_requests=8,
        tp_size=DP * TP,
        dp_size=DP,
        enable_dp_attention=True,
    )
    mesh = jax.make_mesh((DP, TP), ("data", "tp"), devices=jax.devices()[: DP * TP])
    front = LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        mesh,
        policy=policy,
        max_batch_size=4,
        chunked_prefill_size=16,
        record_logits=True,
        model_config=model.config,
    )
    rng = np.random.default_rng(5)
    sids = [front.open_session() for _ in range(SESSIONS)]
    done: dict[str, Any] = {}
    for turn in range(TURNS):
        reqs = [
            ServingReq(f"{sid}/{turn}", rng.integers(0, 128, NEW).tolist(), max_new_tokens=OUT, session_id=sid)
            for sid in sids
        ]
        front.run(reqs)
        for sid, req in zip(sids, reqs, strict=True):
            done[req.rid] = req
            assert front.rank_of[req.rid] == front.session_rank(sid)
            if turn:
                assert len(req.origin_input_ids) - req.first_cached_tokens == NEW + 1
    assert {front.session_rank(sid) for sid in sids} == {0, 1}
    for sid in sids:
        front.close_session(sid)
    assert front.leak_free()
    assert_matches_transformers(hf, done, max_new=OUT, atol=1e-4)
