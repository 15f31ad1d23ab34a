"""Nemotron-H (Mamba2 mixers, attention without RoPE, ReLU² MLPs) served through kvjax gives
Transformers' greedy tokens; logits agree with Transformers' full forward over prompt + output.

A tiny random-weight ``NemotronHForCausalLM`` (float32, blocks ``M - * M -``: two Mamba2 mixers with
two groups, one attention block, two MLP blocks) is saved with ``save_pretrained`` and served by
kvjax at page size 1 with chunked prefill of 8 tokens, on the rounds of
``test_parity_qwen3_next`` (shared system prompt, a two-turn chat): later prompts start from a
checkpoint forked into their state slot. Tokens are compared with Transformers' greedy
``generate``. Logits are compared with Transformers' full forward over prompt + output (teacher
forcing). ``dt`` is clamped to the config's ``time_step_limit`` (default ``(0, inf)``), as
Transformers 5.25 does on both its paths (5.24 and earlier clamped its prompt path below at the
initialisation bound ``time_step_min`` and its decode path not at all; the parity extra requires
5.25).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.scheduler import ServingReq
from tests.serve.parity_harness import (
    TINY_CONFIG,
    assert_no_near_tie,
    serve_recurrent,
    tiny_checkpoint,
    torch,
    transformers,
)
from tests.serve.random_workloads import NEMOTRON_H_BLOCKS, TINY_LAYER_SIZES

LOGIT_ATOL = 1e-4
MIN_MARGIN = 2e-3  # Qwen3-Next's (10x its tolerance of 2e-4)
MAX_NEW = 6
MODEL_SEED = 0


def nemotron_h_checkpoint(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[Any, LoadedModel]:
    """``(hf, model)`` of the tiny Nemotron-H of the module docstring (weights of ``MODEL_SEED``),
    its checkpoint saved into a new temporary directory ``name``."""
    config = transformers.NemotronHConfig(**TINY_CONFIG, **TINY_LAYER_SIZES, **NEMOTRON_H_BLOCKS)
    return tiny_checkpoint(config, tmp_path_factory, name, seed=MODEL_SEED)


def assert_matches_full_forward(hf: Any, done: dict[str, ServingReq], *, max_new: int) -> None:
    """Each request's ``max_new`` tokens equal Transformers' greedy ``generate`` on its prompt, and
    its logits agree within ``LOGIT_ATOL`` with Transformers' full forward over prompt + output,
    no step a near tie (a top-2 margin of at least ``MIN_MARGIN``)."""
    for name, req in done.items():
        prompt = list(req.origin_input_ids)
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)[0, len(prompt) :]
            full = hf(torch.tensor([prompt + req.output_ids])).logits[0].numpy()
        logits = full[len(prompt) - 1 : len(prompt) - 1 + max_new]
        assert_no_near_tie(name, logits, MIN_MARGIN)
        assert req.output_ids == want.tolist(), f"{name}: kvjax {req.output_ids} != transformers {want.tolist()}"
        np.testing.assert_allclose(np.stack(req.logits), logits, atol=LOGIT_ATOL, rtol=0, err_msg=f"{name}: logits")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[object, LoadedModel]:
    return nemotron_h_checkpoint(tmp_path_factory, "nemotron_h")


@pytest.mark.slow  # the suite's time budget: the second CI stage runs it
def test_prefix_reuse_from_checkpoints_multi_turn_and_chunked_prefill(model):
    hf, loaded = model
    _, done = serve_recurrent(loaded, MAX_NEW, max_total_tokens=1024, max_running_requests=4, max_mamba_cache_size=32)
    assert all((done[n].first_cached_tokens or 0) >= 16 for n in ("b", "c", "d"))
    assert_matches_full_forward(hf, done, max_new=MAX_NEW)


def test_transformers_5_block_names_and_conv_dtype_are_read():
    from kvjax import ModelSpec
    from kvjax.layer_kinds import LayerKind

    raw = {
        "model_type": "nemotron_h",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "layers_block_type": ["linear_attention", "mlp", "full_attention"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "dtype": "float32",
    }
    spec = ModelSpec.from_hf_config(raw)
    assert spec.layer_kinds == (LayerKind.RECURRENT, LayerKind.NONE, LayerKind.FULL)
    assert spec.recurrent is not None and spec.recurrent.conv_dtype == "float32"
    assert spec.recurrent.conv_state_shapes == ((4 * 16 + 2 * 2 * 16, 3),)


def test_the_dt_clamp_is_the_configs_time_step_limit_and_a_malformed_one_is_refused():
    from kvjax.errors import ConfigError
    from kvjax.serve.families.nemotron_h import _time_step_limit

    assert _time_step_limit({"time_step_min": 0.001}) == (0.0, float("inf"))  # an init bound, not a clamp
    assert _time_step_limit({"time_step_limit": [0.0, float("inf")]}) == (0.0, float("inf"))
    assert _time_step_limit({"time_step_limit": [0.0, {"__float__": "Infinity"}]}) == (0.0, float("inf"))
    assert _time_step_limit({"mamba_dt_limit": [0.01, 0.1]}) == (0.01, 0.1)
    for bad in ([0.1, 0.01], [0.1], "fast", [0.0, {"__float__": "lots"}], [0.0, {"inf": 1}]):
        with pytest.raises(ConfigError, match="time_step_limit"):
            _time_step_limit({"time_step_limit": bad})
