"""The real trained model at tensor parallelism 3: SmolLM2-135M-Instruct (``tests/serve/real_model.py``)
has 3 KV heads and 9 query heads, so at tp 3 each of 3 devices holds one KV head and three query
heads, with the MLP (1536 = 3 x 512) and vocabulary (49152 = 3 x 16384) split Megatron style.

The chat workload (four prompts sharing the system prompt, then a second turn) is served at page
size 16 in a pool small enough to evict; every request's tokens equal Transformers' greedy
``generate`` on the same GGUF file and its logits agree within ``LOGIT_ATOL``.
"""

from __future__ import annotations

import pytest

from kvjax.pools import MHAKVPool
from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve.parity_harness import assert_matches_transformers, build_scheduler
from tests.serve.real_model import LOGIT_ATOL, MAX_NEW, kvjax_model, transformers_model
from tests.serve.test_real_model import _serve_chat

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_tp_3_one_kv_head_per_device_with_prefix_reuse_and_eviction():
    model = kvjax_model()
    assert model.spec.num_kv_heads == 3
    sched = build_scheduler(model, mesh=mesh_of(3), tp_size=3, page_size=16, max_total_tokens=256)
    done = _serve_chat(sched)
    assert isinstance(sched.cache.pools.kv, MHAKVPool) and sched.cache.pools.kv.num_kv_heads == 3
    assert_sharded(sched, 3)
    assert sched.stats.cached_tokens > 0
    assert_matches_transformers(transformers_model(), done, max_new=MAX_NEW, atol=LOGIT_ATOL)
