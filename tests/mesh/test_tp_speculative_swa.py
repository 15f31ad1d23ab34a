"""Speculative decoding (STANDALONE) over sliding-window caches under tensor parallelism, against
Hugging Face Transformers (issue 35).

The tiny gpt-oss and Gemma 3 checkpoints of ``tests/serve/test_speculative_swa.py`` (2 KV heads,
window 8) and its pure sliding-window Mistral are served over a ``"tp"`` mesh of 2: the SWA pools
(hybrid: full and SWA sub-pools; pure: one SWA pool) and the draft's ``kv_draft`` split over the
mesh by KV heads, the target's and the draft's weights split Megatron style, both steps jitted
with the mesh's shardings. Every request's tokens equal
Transformers' greedy ``generate`` and the target's verify logits agree within 1e-4; the full and
SWA accounting holds after every step (``check_accounting``) and the cache is leak free after.

The command line's part is proven where it adds something: ``generate`` with a STANDALONE draft
over a sliding-window preset in ``tests/serve/test_speculative_swa.py``, and with ``--tp 2`` in
``tests/mesh/test_tp_speculative.py``; the cases here serve the same caches at tp 2 in process.
"""

from __future__ import annotations

import pytest

from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve.parity_harness import assert_matches_transformers
from tests.serve.test_parity_mistral_swa import PROMPT_SEED as MISTRAL_PROMPT_SEED
from tests.serve.test_speculative_swa import LOGIT_ATOL, LONG, MAX_NEW, serve
from tests.serve.test_speculative_swa import family as family  # noqa: F401, PLC0414  (the fixture)
from tests.serve.test_speculative_swa import mistral as mistral  # noqa: F401, PLC0414  (the fixture)

pytestmark = pytest.mark.mesh

TP = 2


@pytest.mark.parametrize("family", ["gpt_oss"], indirect=True)
def test_tp2_the_target_as_its_own_draft_accepts_everything_through_reuse_and_chunks(family):
    sched, done, _ = serve(
        family, "target", page_size=4, max_total_tokens=1024, max_new=LONG, mesh=mesh_of(TP), tp_size=TP
    )
    assert_sharded(sched, TP)
    assert sched.proposer.stats.acceptance_rate == 1.0
    assert sched.stats.cached_tokens > 0 and (done["d"].first_cached_tokens or 0) >= 16
    assert_matches_transformers(family["hf"], done, max_new=LONG, atol=LOGIT_ATOL)


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_tp2_a_partly_agreeing_draft_evicts_retracts_and_rolls_back(family):
    sched, done, evicted = serve(family, "first-layer", page_size=1, max_total_tokens=64, mesh=mesh_of(TP), tp_size=TP)
    assert_sharded(sched, TP)
    stats = sched.proposer.stats
    assert 0 < stats.accepted_tokens < stats.proposed_tokens and stats.rolled_back_slots > 0, f"{stats}"
    assert evicted["full"] > 0 and evicted["swa"] > 0 and sched.stats.retractions > 0
    assert_matches_transformers(family["hf"], done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_tp2_pure_sliding_window_target_with_a_small_pool(mistral):
    sched, done, _ = serve(
        mistral,
        "first-layer",
        page_size=1,
        max_total_tokens=48,
        seed=MISTRAL_PROMPT_SEED,
        mesh=mesh_of(TP),
        tp_size=TP,
    )
    assert_sharded(sched, TP)
    assert not sched.cache.full_tokens_per_layer
    assert sched.proposer.stats.rolled_back_slots > 0 and sched.stats.retractions > 0
    assert_matches_transformers(mistral["hf"], done, max_new=MAX_NEW, atol=LOGIT_ATOL)
