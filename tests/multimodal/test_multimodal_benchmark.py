"""``benchmarks/multimodal.py --tiny``: the report's shape and the relations its figures must
satisfy (a larger embedding cache never runs the encoder more; the tree's reuse does not depend
on the embedding cache)."""

from __future__ import annotations

import pytest

from tests.benchmark_runs import run_tiny


def test_tiny_report():
    pytest.importorskip("transformers")
    report = run_tiny("benchmarks/multimodal.py")
    one = report["hash"]["llava_1_5"]
    assert one["hash_ms"] > 0 and one["encoder_ms"] > 0 and one["hash_over_encoder"] > 0
    for loop in report["agent_loop"].values():
        rows = loop["by_cache_size"]
        assert [r["cache_mib"] for r in rows] == sorted(r["cache_mib"] for r in rows)
        runs = [r["encoder_runs"] for r in rows]
        assert runs == sorted(runs, reverse=True) and runs[0] > runs[-1]
        assert all(r["encoder_runs"] >= loop["distinct_images"] for r in rows)
        assert rows[0]["embedding_hits"] == 0  # a cache of 0 bytes keeps no image
        assert len({r["prefill_tokens_saved_by_the_tree"] for r in rows}) == 1
        for r in rows:
            assert (
                r["embedding_hits"] + r["embedding_misses"] + r["items_reused_from_the_tree"]
                == loop["images_in_prompts"]
            )
            # the encoder time left and saved add up to encoding every image of every prompt
            every = loop["images_in_prompts"] * one["encoder_ms"] / 1000
            assert abs(r["encoder_seconds"] + r["encoder_seconds_saved"] - every) < 0.02
