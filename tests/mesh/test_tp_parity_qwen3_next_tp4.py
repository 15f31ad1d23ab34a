"""Qwen3-Next at tp 4 over CPU devices (4 key heads, one per rank) gives Transformers' tokens and
logits (within 1e-4, float32) through prefix reuse from state checkpoints, chunked prefill, eviction
of KV and checkpoints, and retraction (each asserted). A file of its own so the mesh stage's two
workers run it beside the tp 2 case (``test_tp_parity_qwen3_next.py``); the model and the check:
``tests/mesh/qwen3_next_tp.py``.
"""

from __future__ import annotations

import pytest

from tests.mesh.qwen3_next_tp import check_head_parallel_serving, qwen3_next_checkpoint

TP = 4


@pytest.mark.timeout(600)  # ~2 min on a quiet machine; shared CPUs stretch it
def test_head_parallel_gated_delta_net_reuse_eviction_and_retraction(tmp_path_factory):
    check_head_parallel_serving(TP, *qwen3_next_checkpoint(TP, tmp_path_factory))
