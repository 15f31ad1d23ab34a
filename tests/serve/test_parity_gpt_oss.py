"""gpt-oss served through the hybrid-SWA cache matches Hugging Face Transformers.

A tiny random-weight ``GptOssForCausalLM`` (float32, fixed seed; layers sliding, full, sliding,
full; window 8 tokens; attention sinks and q/k/v/o biases; YaRN RoPE (factor 8 over an original
64 positions, so the ramp and the attention scaling both matter); 4 fused experts, top 2, with
router and expert biases and the clamped SwiGLU) is saved with ``save_pretrained`` and loaded by
kvjax, then served through the scenarios of ``swa_parity`` (the sliding-window rounds, shared with
Gemma 3; its docstring says what each proves): greedy tokens and logits equal to Transformers'.
"""

from __future__ import annotations

import pytest

from kvjax.serve.checkpoint import LoadedModel
from tests.serve import swa_parity
from tests.serve.parity_harness import TINY_CONFIG, tiny_checkpoint, transformers

WINDOW = 8

CONFIG = dict(
    TINY_CONFIG,
    intermediate_size=32,
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=512,  # = 64 x factor 8: the YaRN config Transformers expects
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150_000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
)


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory) -> tuple[object, LoadedModel]:
    return tiny_checkpoint(transformers.GptOssConfig(**CONFIG), tmp_path_factory, "gpt_oss")


class TestGptOss(swa_parity.HybridSWAParityTests):
    """The hybrid sliding-window scenarios (``swa_parity``) on the tiny checkpoint."""
