"""Prefill/decode disaggregation with speculative decoding on both sides (issue 36: "the draft
model's KV when decoding speculatively"): the prefill server's paired prefill writes the target's
pool and the draft's ``kv_draft``; the decode server pulls both (each with its own model's KV heads)
and decodes in speculative rounds.

With the target as its own draft, every proposal must be accepted: it is only when the draft's
pulled KV equals the target's at every position. With a one-layer draft (random weights) the rounds
mix accepted and rejected proposals. Either way the tokens are the plain colocated loop's. The
prefill side runs at tp 2 and page size 4, the decode side at tp 1 and page size 8 (and the other
way round); both sides end leak free.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.disaggregation.decode import DecodeServer
from kvjax.disaggregation.prefill import PrefillServer
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative import DraftDecoding
from tests.mesh.tp_serving import mesh_of

pytestmark = pytest.mark.mesh

K = 3
MAX_NEW = 8
TARGET = ModelSpec.preset("tiny")


def _scheduler(tp: int, page: int, mode: str, draft: Any = None, draft_params: Any = None) -> Scheduler:
    speculative = (
        dict(speculative_algorithm="STANDALONE", speculative_num_steps=K, speculative_num_draft_tokens=K + 1)
        if draft is not None
        else {}
    )
    radix = {"disaggregation_decode_enable_radix_cache": True} if mode == "decode" else {}
    config = CacheConfig(
        context_length=256,
        page_size=page,
        max_total_tokens=512,
        chunked_prefill_size=32,
        tp_size=tp,
        disaggregation_mode=mode,
        **radix,
        **speculative,
    )
    cache = build_kv_cache(TARGET, config, mesh=mesh_of(tp) if tp > 1 else None, draft_spec=draft)
    proposer = DraftDecoding(draft, draft_params, K) if draft is not None else None
    params = init_params(TARGET, seed=0)
    return Scheduler(TARGET, cache, params, max_batch_size=4, overlap=draft is None, proposer=proposer)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(0, TARGET.vocab_size, 20).tolist()
    return [shared + rng.integers(0, TARGET.vocab_size, n).tolist() for n in (5, 13)] + [
        rng.integers(0, TARGET.vocab_size, n).tolist() for n in (7, 41)
    ]


@pytest.fixture(scope="module")
def colocated() -> dict[int, list[int]]:
    done = _scheduler(1, 4, "null").run([ServingReq(i, p, max_new_tokens=MAX_NEW) for i, p in enumerate(_prompts())])
    return {r.rid: list(r.output_ids) for r in done}


@pytest.mark.parametrize("sides", [((2, 4), (1, 8)), ((1, 8), (2, 4))], ids=["tp2p4-tp1p8", "tp1p8-tp2p4"])
@pytest.mark.parametrize("draft_kind", ["target", "one-layer"])
def test_a_speculative_decode_server_pulls_the_drafts_kv_with_the_targets(colocated, sides, draft_kind):
    if draft_kind == "target":
        draft, draft_params = TARGET, init_params(TARGET, seed=0)
    else:
        draft = ModelSpec.preset("tiny", num_hidden_layers=1)
        draft_params = init_params(draft, seed=1)
    secret = secrets.token_hex(32)
    (ptp, ppage), (dtp, dpage) = sides
    prefill = PrefillServer(_scheduler(ptp, ppage, "prefill", draft, draft_params), fingerprint="tiny", secret=secret)
    stop = threading.Event()
    thread = threading.Thread(target=prefill.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    try:
        decode = DecodeServer(
            _scheduler(dtp, dpage, "decode", draft, draft_params),
            fingerprint="tiny",
            prefill=[prefill.address],
            secret=secret,
        )
        assert [m.name for m in decode.movers.movers] == ["kv", "kv_draft"]
        done = decode.run([ServingReq(i, p, max_new_tokens=MAX_NEW) for i, p in enumerate(_prompts())])
        assert [r.abort_reason for r in done] == [None] * len(done)
        assert {r.rid: list(r.output_ids) for r in done} == colocated
        stats = decode.scheduler.proposer.stats
        if draft_kind == "target":
            assert stats.acceptance_rate == 1.0, f"a pulled draft page differs from the target's: {stats}"
        else:
            assert 0 <= stats.accepted_tokens < stats.proposed_tokens
        assert decode.reused_tokens > 0  # the shared prefix, held by the decode tree
        assert decode.leak_free()
        decode.close()
    finally:
        stop.set()
        thread.join(10)
    assert prefill.scheduler.leak_free() and not prefill.snapshots
    prefill.close()
