"""Pool layouts: shapes, padding and bytes, computed without jax (one place per kind)."""

from __future__ import annotations

import pytest

from kvjax import ConfigError
from kvjax.layout.alignment import head_dim_alignment, tpu_packing
from kvjax.layout.mha import MHALayout
from kvjax.layout.mla import MLALayout
from kvjax.layout.recurrent import RecurrentLayout
from kvjax.layout.storage import storage_dtype_name
from kvjax.spec import RecurrentStateSpec


def test_alignment_and_packing_rules():
    assert head_dim_alignment("tpu") == 128 and head_dim_alignment("cpu") == 1
    assert (tpu_packing(4), tpu_packing(2), tpu_packing(1)) == (1, 2, 4)


def test_storage_dtype_names_bits_on_cpu_only():
    assert storage_dtype_name("bfloat16", "cpu") == "uint16"
    assert storage_dtype_name("bfloat16", "tpu") == "bfloat16"
    assert storage_dtype_name("fp8_e4m3", "cpu") == "uint8"
    assert storage_dtype_name("fp8_e4m3", "tpu") == "float8_e4m3fn"
    assert storage_dtype_name("float32", "cpu") == "float32"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        storage_dtype_name("int4", "cpu")


def test_mha_layout_shape_bytes_and_padding():
    layout = MHALayout.for_platform(
        num_kv_heads=2, head_dim=64, v_head_dim=None, page_size=16, dtype="bfloat16", platform="tpu"
    )
    assert layout.shape(10) == (11, 16, 4, 128)
    assert layout.bytes_per_token_per_layer == 2 * 2 * 128 * 2
    assert layout.padding() == ("head_dim 64 -> 128 (TPU lane width)",)
    planned = layout.pool_plan("kv", "mha", num_pages=10, layer_ids=(0, 1, 2))
    assert planned.nbytes == 3 * 11 * 16 * layout.bytes_per_token_per_layer
    assert planned.bytes_per_token == 3 * layout.bytes_per_token_per_layer


def test_mla_layout_with_indexer():
    layout = MLALayout.for_platform(
        kv_lora_rank=512, qk_rope_head_dim=64, page_size=16, dtype="bfloat16", platform="tpu", index_head_dim=128
    )
    latent, indexer = layout.pool_plans(num_pages=4, layer_ids=(0, 1), built=False)
    assert latent.shape == (5, 16, 640) and latent.bytes_per_token == 2 * 640 * 2
    assert indexer.shape == (5, 16 * 132) and indexer.dtype == "uint8" and indexer.bytes_per_token == 2 * 132


def test_recurrent_layout_splits_heads_and_channels_per_rank():
    state = RecurrentStateSpec(((256, 3),), "bfloat16", (8, 64, 64), "float32")
    rank = RecurrentLayout.per_rank(state, 4)
    assert rank.conv_state_shapes == ((64, 3),) and rank.ssm_state_shape == (2, 64, 64)
    assert rank.bytes_per_slot_per_layer == 64 * 3 * 2 + 2 * 64 * 64 * 4
    conv, ssm = rank.pool_plans(num_slots=5, layer_ids=(1, 3), built=False)
    assert conv.shape == (2, 6, 64, 3) and ssm.shape == (2, 6, 2, 64, 64)
    with pytest.raises(ConfigError, match="tp_size"):
        RecurrentLayout.per_rank(state, 3)
