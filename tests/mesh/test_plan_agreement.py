"""The planner and the build agree with what runs: per-device pool bytes and tokens that fit, as
``python -m kvjax plan --tp N --dp M --json`` prints them, equal the built arrays' per-device
shards (``arr.addressable_shards[i].data.nbytes``) on an 8-device CPU mesh, for MHA (KV heads
split, and replicated when TP exceeds them), sliding-window, MLA (latent replicated over TP) and
recurrent pools, with and without DP attention.

One subprocess builds every case: the host platform must be split into 8 devices before jax
starts. Each case's plan is printed by the command line itself, then the same configuration is
built over ``kvjax.mesh_check.make_serving_mesh`` (``("tp",)``, or ``("data", "tp")`` under DP
attention).
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest

from tests.mesh.subprocess_run import run_with_devices

BUDGET = 4 << 20  # bytes per device: a few hundred pages of the tiny models
ROWS = 4

# A Qwen3-Next-shaped hybrid (3 gated-delta-net layers, 1 full) small enough for a CPU test; its
# conv channels (512) split into lane-dense rows at TP 2 and 4.
TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "full_attention_interval": 4,
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "head_dim": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "max_position_embeddings": 512,
    "intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "vocab_size": 1000,
    "torch_dtype": "float32",
}

# (id, model, tp, dp, page size): tp and dp as typed on the command line.
CASES = [
    ("mha-tp1", "tiny", 1, 1, 16),
    ("mha-tp2", "tiny", 2, 1, 16),
    ("mha-tp4-replicated", "tiny", 4, 1, 16),
    ("mha-dp2-tp4", "tiny", 4, 2, 16),
    ("swa-tp2", "mistral-swa-tiny", 2, 1, 16),
    ("swa-dp2-tp4", "gemma3-tiny", 4, 2, 16),
    ("mla-tp2", "deepseek-tiny", 2, 1, 16),
    ("mla-dp2-tp4", "deepseek-tiny", 4, 2, 16),
    ("recurrent-tp2", "qwen3-next-tiny", 2, 1, 1),
    ("recurrent-tp4", "qwen3-next-tiny", 4, 1, 1),
    ("recurrent-dp2-tp4", "qwen3-next-tiny", 4, 2, 1),
]

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import jax
    from kvjax import CacheConfig, build_kv_cache
    from kvjax.cli import main
    from kvjax.mesh_check import make_serving_mesh
    from kvjax.spec import ModelSpec

    budget, rows, cases = json.loads(sys.argv[1])
    results = {}
    for name, model, tp, dp, page in cases:
        flags = ["plan", "--model", model, "--memory", str(budget), "--tp", str(tp), "--dp", str(dp),
                 "--max-running-requests", str(rows), "--page-size", str(page), "--json"]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(flags) == 0, flags
        plan = json.loads(printed.getvalue())
        config = CacheConfig(memory_budget_bytes=budget, tp_size=tp, dp_size=dp, enable_dp_attention=dp > 1,
                             max_running_requests=rows, page_size=page, platform="tpu")
        mesh = make_serving_mesh(tp, dp, dp > 1)
        cache = build_kv_cache(ModelSpec.resolve(model), config, mesh=mesh)
        built = {}
        for pool in cache.pools:
            per_device = {}
            for leaf in jax.tree.leaves(cache.pools[pool]):
                for shard in leaf.addressable_shards:
                    key = "layers" if leaf.ndim >= 2 else "scales"
                    slot = per_device.setdefault(str(shard.device.id), {"layers": 0, "scales": 0})
                    slot[key] += shard.data.nbytes
            first = jax.tree.leaves(cache.pools[pool])[0]
            built[pool] = {"per_device": per_device, "rows": first.addressable_shards[0].data.shape[0],
                           "devices": len(per_device)}
        results[name] = {"plan": plan, "built": built, "mesh": dict(mesh.shape),
                         "allocator": {k: getattr(cache.allocator, k, None) for k in ("size", "size_full", "size_swa")}}
    print(json.dumps(results))
    """
)

# Plan pool kind -> the name of the built pool that holds it.
BUILT_POOL = {"mha": "kv", "mla": "kv", "swa": "swa", "recurrent": "recurrent"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    config = tmp_path_factory.mktemp("models") / "qwen3-next-tiny.json"
    config.write_text(json.dumps(TINY_QWEN3_NEXT))
    cases = [
        [name, str(config) if model == "qwen3-next-tiny" else model, tp, dp, page]
        for name, model, tp, dp, page in CASES
    ]
    return run_with_devices(["-c", SCRIPT, json.dumps([BUDGET, ROWS, cases])], timeout=540)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_printed_plan_equals_the_built_shards_on_every_device(runs: dict[str, Any], case: tuple) -> None:
    name, _model, tp, dp, _page = case
    run = runs[name]
    plan, built = run["plan"], run["built"]
    assert run["mesh"] == ({"data": dp, "tp": tp // dp} if dp > 1 else {"tp": tp})
    assert (plan["tp_size"], plan["dp_size"], plan["attn_tp_size"]) == (tp, dp, tp // dp)

    planned: dict[str, int] = {}
    layers: dict[str, int] = {}
    for pool in plan["pools"]:
        if pool["memory"] != "device":
            continue
        target = BUILT_POOL[pool["kind"]]
        planned[target] = planned.get(target, 0) + pool["nbytes"]
        layers[target] = max(layers.get(target, 0), pool["count"])
    assert set(planned) == set(built), f"{name}: planned pools {sorted(planned)}, built {sorted(built)}"
    for pool, expected in planned.items():
        per_device = built[pool]["per_device"]
        assert built[pool]["devices"] == tp, f"{name}: {pool} must live on all {tp} devices of the mesh"
        for device, got in per_device.items():
            assert got["layers"] == expected, (
                f"{name}: pool {pool} on device {device} holds {got['layers']} bytes, the plan prints {expected}"
            )
            # The per-layer float32 K/V scales (kvjax.pools.mha) are the only bytes the plan leaves out.
            assert got["scales"] <= 8 * max(layers[pool], 2) * 2, f"{name}: {pool}: {got['scales']} bytes of scales"
    assert sum(planned.values()) == plan["device_bytes"]
    assert plan["device_bytes"] <= BUDGET, "the budget pays for every device array"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c for c in CASES if not c[0].startswith("recurrent")], ids=lambda c: c[0])
def test_printed_tokens_are_the_built_pool_rows(runs: dict[str, Any], case: tuple) -> None:
    """Tokens that fit per device: the printed ``max_total_tokens`` (for a hybrid SWA model the
    printed full and sliding tokens per layer) are the allocator's sizes and the built pool's pages
    (minus the trash page) times the page size."""
    name, _model, _tp, _dp, page = case
    run = runs[name]
    plan, allocator = run["plan"], run["allocator"]
    if plan["is_hybrid_swa"]:
        # A model of only sliding layers has one plain allocator over its SWA pool.
        swa_size = allocator["size_swa"] if plan["num_full_layers"] else allocator["size"]
        assert swa_size == plan["swa_tokens_per_layer"]
        if plan["num_full_layers"]:
            assert allocator["size_full"] == plan["full_tokens_per_layer"] == plan["max_total_tokens"]
    else:
        assert allocator["size"] == plan["max_total_tokens"]
    if "kv" in run["built"]:
        assert (run["built"]["kv"]["rows"] - 1) * page == plan["max_total_tokens"]


def test_heads_split_over_tp_and_replicate_beyond_the_kv_heads(runs: dict[str, Any]) -> None:
    """``tiny`` has 2 KV heads: TP 2 holds one head per device; TP 4 also one (each head on two
    devices, as SGLang replicates), so its tokens per device equal TP 2's; TP 1 holds both."""
    tokens = {name: runs[name]["plan"]["max_total_tokens"] for name in ("mha-tp1", "mha-tp2", "mha-tp4-replicated")}
    assert runs["mha-tp4-replicated"]["plan"]["kv_head_replicas"] == 2
    assert tokens["mha-tp2"] == tokens["mha-tp4-replicated"] > tokens["mha-tp1"]
    # DP attention at tp 4 / dp 2: attention TP 2, one head per device, like tp 2.
    assert runs["mha-dp2-tp4"]["plan"]["max_total_tokens"] == tokens["mha-tp2"]


def test_mla_latent_is_replicated_over_tp(runs: dict[str, Any]) -> None:
    """The latent (one shared head) is replicated on every attention-TP rank, as sglang-jax does: TP does
    not grow the tokens per device."""
    assert runs["mla-tp2"]["plan"]["max_total_tokens"] == runs["mla-dp2-tp4"]["plan"]["max_total_tokens"]
    assert runs["mla-tp2"]["plan"]["kv_head_replicas"] == 2
