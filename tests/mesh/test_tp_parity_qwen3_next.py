"""Qwen3-Next (gated delta net layers and a full-attention layer) at tp 2 over CPU devices gives
Transformers' tokens and logits (within 1e-4, float32) through prefix reuse from state checkpoints,
chunked prefill, eviction of KV and checkpoints, and retraction (each asserted); a model whose key
heads do not divide over tp is refused. The tp 4 case: ``test_tp_parity_qwen3_next_tp4.py``; the
model and the check: ``tests/mesh/qwen3_next_tp.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.errors import ConfigError
from tests.mesh.qwen3_next_tp import check_head_parallel_serving, qwen3_next_checkpoint
from tests.mesh.tp_serving import mesh_of

TP = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The tp 2 model (2 key heads): ``(Transformers model, kvjax's load)``."""
    return qwen3_next_checkpoint(TP, tmp_path_factory)


@pytest.mark.timeout(600)  # ~1.5 min on a quiet machine; shared CPUs stretch it
def test_head_parallel_gated_delta_net_reuse_eviction_and_retraction(checkpoint):
    check_head_parallel_serving(TP, *checkpoint)


def test_key_heads_that_do_not_divide_are_refused_before_anything_is_built(checkpoint):
    _, model = checkpoint
    with pytest.raises(ConfigError, match="tp_size"):
        build_kv_cache(model.spec, CacheConfig(tp_size=4, max_total_tokens=56, context_length=64), mesh=mesh_of(4))
