"""Gemma 3 (text) served through the hybrid-SWA cache matches Hugging Face Transformers.

A tiny random-weight ``Gemma3ForCausalLM`` (float32, fixed seed; layers sliding, sliding, full,
sliding; window 8 tokens; per-layer RoPE: linear-scaled base 1e6 on the full layer, 1e4 on the
sliding ones; ``query_pre_attn_scalar`` 24, not the head dim) is saved with ``save_pretrained`` and
loaded by kvjax, then served through the scenarios of ``swa_parity`` (the sliding-window rounds, shared with
gpt-oss; its docstring says what each proves): greedy tokens and logits equal to Transformers'.
"""

from __future__ import annotations

import pytest

from kvjax.serve.checkpoint import LoadedModel
from tests.serve import swa_parity
from tests.serve.parity_harness import TINY_CONFIG, tiny_checkpoint, transformers
from tests.serve.random_workloads import TINY_LAYER_SIZES

WINDOW = 8

CONFIG = dict(
    TINY_CONFIG,
    **TINY_LAYER_SIZES,
    num_hidden_layers=4,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
)


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory) -> tuple[object, LoadedModel]:
    return tiny_checkpoint(transformers.Gemma3TextConfig(**CONFIG), tmp_path_factory, "gemma3")


class TestGemma3(swa_parity.HybridSWAParityTests):
    """The hybrid sliding-window scenarios (``swa_parity``) on the tiny checkpoint."""


@pytest.mark.slow  # ~40 s: the tree and the engine are covered in the default suite (tests/radix)
def test_host_tier_loads_evicted_prefixes_back_with_the_last_window(swa_model):
    swa_parity.host_tier_load_back(*swa_model)


def test_retracted_requests_are_restored_with_their_window(swa_model):
    swa_parity.page_1_retract_and_restore(*swa_model)
