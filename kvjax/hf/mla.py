"""DeepSeek-V2 / V3 / V3.2: multi-head latent attention.

Every layer MLA with one latent KV head; ``head_dim = qk_nope_head_dim + qk_rope_head_dim`` (the K
head); an indexer (``index_topk``, or ``deepseek_v32``) makes it DeepSeek sparse attention (DSA).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvjax.hf import keys
from kvjax.hf.keys import Fields
from kvjax.layer_kinds import LayerKind


def parse_deepseek_mla(config: Mapping[str, Any], family: str) -> Fields:
    keys.require(config, ("qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank", "v_head_dim"), family)
    nope = keys.integer(config, "qk_nope_head_dim", family)
    rope = keys.integer(config, "qk_rope_head_dim", family)
    # The latent row is shared by every head, so there is no KV-head count to miss.
    fields = keys.attention_fields(config, family, head_dim_default=nope + rope, kv_heads_default=1)
    n = fields["num_hidden_layers"]
    fields.update(
        layer_kinds=(LayerKind.MLA,) * n,
        num_kv_heads=1,
        # Some configs also carry head_dim (= qk_rope_head_dim); the K head is nope + rope.
        head_dim=nope + rope,
        v_head_dim=keys.integer(config, "v_head_dim", family),
        kv_lora_rank=keys.integer(config, "kv_lora_rank", family),
        qk_rope_head_dim=rope,
        num_nextn_predict_layers=keys.integer(config, "num_nextn_predict_layers", family, 0, minimum=0),
    )
    if family == "deepseek_v32" or config.get("index_topk") is not None:
        fields["is_dsa"] = True
        fields["index_head_dim"] = keys.integer(config, "index_head_dim", family)
    return fields
