"""The ``cpu_tensor`` decode retraction backup with a STANDALONE draft, against Transformers.

The target is its own draft (the tiny parity Llama: full attention; the tiny parity DeepSeek-V2:
MLA; the tiny parity Gemma 3: sliding layers beside a full one, whose backup holds the full side
and the window's sliding side), so it must accept every proposal. Served through the two rounds of ``parity_harness`` at
page size 1 on a pool small enough to retract, with overlap scheduling (rounds chained on the
device) and the backup set: retracted requests are
restored from their copies (counted: not recomputed), and every proposal is still accepted, which
holds only if their draft pages (``"kv_draft"``) came back with the target's; tokens equal
Transformers' greedy ``generate``, logits within ``ATOL``, leak free. A backup made to copy the
target's pool alone is refused by name when the speculative scheduler is built.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvjax import CacheConfig, ModelSpec
from kvjax.build import build_kv_cache
from kvjax.errors import ConfigError
from kvjax.serve.generate import scheduler_for
from kvjax.serve.model import init_params
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.speculative import DraftDecoding, speculative_scheduler
from kvjax.transfers.retraction_backup import RetractionBackup
from tests.mesh.tp_serving import family_checkpoint
from tests.serve.parity_harness import CHUNK, assert_matches_transformers, parity_cache_config, serve_two_rounds

MAX_NEW = 6
ATOL = 1e-4
K = 3


@pytest.mark.parametrize("name", ["llama", "deepseek_v2", "gemma3"])
def test_retracted_requests_are_restored_with_the_drafts_pages(name: str, tmp_path_factory: Any) -> None:
    hf, model = family_checkpoint(name, tmp_path_factory)
    config = parity_cache_config(
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
        speculative_algorithm="STANDALONE",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        disaggregation_decode_retraction_backup="cpu_tensor",
    )
    cache = build_kv_cache(model.spec, config, draft_spec=model.spec)
    sched = scheduler_for(
        model,
        cache,
        draft=model,
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        overlap=True,
    )
    done = serve_two_rounds(sched, MAX_NEW)  # asserts the cache is leak free
    [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
    backup = ext.retraction
    assert backup.mode == "cpu_tensor" and backup.pool_names[-1] == "kv_draft"
    assert sched.stats.retractions > 0 and backup.restored > 0 and backup.restored_tokens > 0, "not recomputed"
    assert backup.held == 0
    assert isinstance(sched.proposer, DraftDecoding)
    stats = sched.proposer.stats
    assert stats.proposed_tokens > 0 and stats.acceptance_rate == 1.0, f"a draft page did not come back: {stats}"
    assert stats.overlapped_rounds > 0, "the rounds chain on the device with the backup on (overlap scheduling)"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_a_backup_of_the_targets_pool_alone_is_refused_by_name() -> None:
    spec = ModelSpec.preset("tiny")
    config = CacheConfig(
        page_size=4,
        max_total_tokens=256,
        context_length=128,
        speculative_algorithm="STANDALONE",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        disaggregation_decode_retraction_backup="cpu_tensor",
    )
    cache = build_kv_cache(spec, config, draft_spec=spec)
    target_only = RetractionBackupExtension(cache, RetractionBackup("cpu_tensor", 4, pending=cache.pending))
    assert not target_only.restores_pool("kv_draft")
    params = init_params(spec)
    with pytest.raises(ConfigError, match="disaggregation_decode_retraction_backup.*kv_draft"):
        speculative_scheduler(
            spec, cache, params, draft=spec, draft_params=params, num_steps=K, extensions=[target_only]
        )
