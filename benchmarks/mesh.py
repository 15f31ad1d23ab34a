"""Serving on a mesh of chips: what tensor parallelism buys per device, and what it costs in
collectives. Prints one JSON object.

    python benchmarks/mesh.py [--tiny]

Sections:

* ``pool_bytes_per_device``: per-device pool bytes of the same pool (a fixed number of tokens)
  at TP 1/2/4/8, planned for real models (Llama-3-8B, Gemma-3-12B's hybrid SWA, Qwen3-Next's
  recurrent state, DeepSeek-V3's MLA latent), with the ratio to TP 1 (goal ``1/tp`` while the KV
  heads divide, none beyond, where SGLang replicates each head; MLA's latent is replicated over
  TP, so 1.0 there). ``built`` checks the same on
  this machine: the tiny preset built on the 8-device CPU mesh, its arrays' per-device shards.
* ``tokens_per_device_budget``: tokens that fit a 16 GiB per-device budget at TP 1/2/4/8, and at
  ``dp 2`` (DP attention: attention TP = tp / dp, each DP rank with its own pools).
* ``collectives_per_decode_layer``: the serving step itself (``make_sharded_step``, lowered over
  abstract inputs by ``kvjax.serve.abstract_step``) of two-layer models with Llama-3-8B's and
  DeepSeek-V3's MLA layer sizes, compiled for ``v5e:2x4`` and ``v6e:2x4`` at TP 8: the collectives
  of each decoder layer and their bytes against Megatron's minimum (two all-reduces of tokens x
  hidden; ratio, goal 1.0), the collectives outside the layers (embedding, LM head: none, both
  are replicated), per-chip temporaries against the pools, and the MLA latent's replication cost.
  Needs libtpu (the ``tpu`` extra, in an environment of its own); without it the section says so.
* ``step_time_cpu``: a small two-layer model's serving step over a decode batch, sharded over the
  8-device CPU mesh against one device. A CPU figure: the 8 host devices share this machine's
  cores, so it shows the overhead of the sharded program, not a TPU speed-up.
* ``dp_routing``: the prefix-cache hit rate of cache-aware DP routing against SGLang's round robin
  at dp 2 and 4, on the demo workload and a multi-tenant one (``benchmarks/dp_routing.py``: real
  radix trees and allocators per rank, host only), with the ratio and the hit rate of one tree
  shared by all ranks (the ceiling no per-rank routing can beat). ``--tiny`` measures dp 2 only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

# The host platform is split into 8 devices before jax starts (a CPU mesh of 8).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, median_seconds  # noqa: E402
from benchmarks.dp_routing import routing_hit_rates  # noqa: E402
from kvjax import CacheConfig  # noqa: E402
from kvjax.plan import plan_kv_cache  # noqa: E402
from kvjax.spec import ModelSpec  # noqa: E402

GiB = 1 << 30
TP_SIZES = (1, 2, 4, 8)
POOL_TOKENS = 65536
PLANNED_MODELS = {
    "llama-3-8b": "mha",
    "gemma-3-12b": "hybrid swa",
    "qwen3-next-80b-a3b": "recurrent + mha",
    "deepseek-v3": "mla (latent replicated over tp)",
}


def _plan(model: str, **config: Any) -> Any:
    return plan_kv_cache(ModelSpec.preset(model), CacheConfig(page_size=16, **config))


def pool_bytes_per_device(models: dict[str, str]) -> dict[str, Any]:
    """Planned per-device bytes of a ``POOL_TOKENS``-token pool at each TP size."""
    out: dict[str, Any] = {}
    for model, kind in models.items():
        rows: dict[str, Any] = {}
        base = None
        kv_heads = ModelSpec.preset(model).num_kv_heads
        for tp in TP_SIZES:
            plan = _plan(model, max_total_tokens=POOL_TOKENS, max_running_requests=256, tp_size=tp)
            base = plan.device_bytes if base is None else base
            rows[f"tp{tp}"] = {
                "device_bytes": plan.device_bytes,
                "ratio_to_tp1": round(plan.device_bytes / base, 4),
                # 1/tp while the KV heads divide; beyond them each head is replicated (no goal).
                "goal": 1.0 if "mla" in kind else (round(1 / tp, 4) if tp <= kv_heads else None),
                "kv_heads_per_device": plan.num_kv_heads_per_rank,
            }
        out[model] = {"kind": kind, "tokens": POOL_TOKENS, "by_tp": rows}
    return out


def built_pool_bytes_per_device() -> dict[str, Any]:
    """The tiny preset (2 KV heads) built on the CPU mesh: per-device shard bytes at TP 1/2/4
    (TP 4 replicates each head on two devices, so it holds what TP 2 holds)."""
    import jax

    from kvjax import build_kv_cache
    from kvjax.mesh_check import make_serving_mesh

    devices = jax.devices("cpu")
    out: dict[str, Any] = {}
    base = None
    for tp in (1, 2, 4):
        if tp > len(devices):
            break
        config = CacheConfig(max_total_tokens=4096, max_running_requests=4, tp_size=tp)
        cache = build_kv_cache(ModelSpec.preset("tiny"), config, mesh=make_serving_mesh(tp, devices=devices))
        per_device = sum(
            leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(cache.pools) if leaf.ndim >= 2
        )
        base = per_device if base is None else base
        out[f"tp{tp}"] = {
            "device_bytes": per_device,
            "planned_device_bytes": cache.plan.device_bytes,
            "ratio_to_tp1": round(per_device / base, 4),
        }
    return {"model": "tiny (2 KV heads)", "by_tp": out}


def tokens_per_device_budget(models: dict[str, str], budget: int) -> dict[str, Any]:
    """Tokens a ``budget``-byte device holds at each TP size, and with DP attention (dp 2)."""
    out: dict[str, Any] = {}
    for model in models:
        rows: dict[str, Any] = {}
        for tp in TP_SIZES:
            rows[f"tp{tp}"] = _plan(model, memory_budget_bytes=budget, tp_size=tp).max_total_tokens
            if tp >= 2:
                dp = _plan(model, memory_budget_bytes=budget, tp_size=tp, dp_size=2, enable_dp_attention=True)
                rows[f"tp{tp}_dp2"] = dp.max_total_tokens
        out[model] = rows
    return {"budget_bytes_per_device": budget, "max_total_tokens": out}


#: The TPU compile targets: two decoder layers at real layer sizes (a small vocabulary), TP 8, a
#: decode batch of 64 sequences at 2k context (the TPU compile tests check the same programs).
TPU_TARGETS = ("llama-3-8b", "deepseek-v3-mla")
TPU_LAYERS = 2


def _tpu_target(name: str) -> tuple[Any, CacheConfig]:
    """(spec, cache config): Llama's pool 2 GiB per layer (256 MiB per chip), the MLA latent
    160 MiB per layer on every chip."""
    from kvjax.serve.abstract_step import DEEPSEEK_V3_AS_V2, sized_like

    if name == "llama-3-8b":
        spec = sized_like("llama-3-8b", num_layers=TPU_LAYERS, vocab_size=4096)
        return spec, CacheConfig(tp_size=8, page_size=16, max_total_tokens=1 << 19, context_length=2048)
    spec = sized_like("deepseek-v3", num_layers=TPU_LAYERS, vocab_size=4096, **DEEPSEEK_V3_AS_V2)
    return spec, CacheConfig(tp_size=8, page_size=64, max_total_tokens=1 << 17, context_length=2048)


def collectives_per_decode_layer() -> dict[str, Any]:
    """The serving step (``make_sharded_step``) compiled for 8-chip slices without a TPU: its
    collectives per decoder layer against Megatron's minimum, those outside the layers, per-chip
    temporaries against the pools."""
    if importlib.util.find_spec("libtpu") is None:
        return {"measured": False, "why": "libtpu is not installed here: run with the project's tpu extra"}
    from kvjax.serve import compiled_step as reading
    from kvjax.serve.abstract_step import (
        DecodeBatch,
        abstract_step_inputs,
        bytes_per_device,
        lower_sharded_step,
        topology_mesh,
    )
    from kvjax.serve.model import as_model_config

    out: dict[str, Any] = {"measured": True, "layers": TPU_LAYERS, "tp": 8, "batch": "64 decode tokens at 2k context"}
    for topology in ("v5e:2x4", "v6e:2x4"):
        mesh = topology_mesh(topology)
        for name in TPU_TARGETS:
            spec, config = _tpu_target(name)
            model = as_model_config(spec)
            inputs = abstract_step_inputs(spec, config, mesh, DecodeBatch(seqs=64, context=2048))
            compiled = lower_sharded_step(spec, mesh, inputs).compile()
            found = reading.collectives(compiled.as_text())
            tokens = inputs.tokens.shape[0]
            per_layer = [sum(c.nbytes for c in found if c.layer == layer) for layer in range(TPU_LAYERS)]
            minimum = reading.megatron_all_reduce_bytes_per_layer(tokens, model.hidden_size, model.dtype)
            pools = bytes_per_device(inputs.pools)
            memory = compiled.memory_analysis()
            row: dict[str, Any] = {
                "tokens": tokens,
                "collectives_per_layer": [[c.op for c in found if c.layer == layer] for layer in range(TPU_LAYERS)],
                "bytes_per_layer": per_layer,
                "megatron_minimum_bytes_per_layer": minimum,
                "ratio": round(sum(per_layer) / (TPU_LAYERS * minimum), 4),
                "outside_layers": [(c.op, c.nbytes, c.op_name) for c in found if c.layer is None],
                "pool_bytes_per_chip": pools,
                "temp_bytes_per_chip": memory.temp_size_in_bytes,
                "temp_to_pool": round(memory.temp_size_in_bytes / pools, 4),
                "mosaic_kernels": reading.mosaic_kernels(compiled.as_text()),
            }
            if name.endswith("mla"):  # the latent is whole on every chip: tp times a split's bytes
                row["latent_replicated_over_tp"] = {"bytes_per_chip": pools, "if_split_over_tp": pools // 8}
            out[f"{topology} {name}"] = row
    return out


def step_time_cpu(tiny: bool) -> dict[str, Any]:
    """Median seconds of a small model's serving step (``make_sharded_step`` at TP 8 on the CPU
    mesh, ``make_step`` on one device), a decode batch (CPU figure)."""
    import jax

    from kvjax import build_kv_cache
    from kvjax.mesh_check import make_serving_mesh
    from kvjax.serve.abstract_step import DecodeBatch, decode_batch, sized_like
    from kvjax.serve.model import init_params
    from kvjax.serve.step import make_sharded_step, make_step, place_on_mesh

    dims = {
        "hidden_size": 512 if tiny else 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 1024 if tiny else 4096,
        "torch_dtype": "float32",
    }
    spec = sized_like("llama-3-8b", num_layers=2, vocab_size=1024, **dims)
    batch = DecodeBatch(seqs=4 if tiny else 16, context=256 if tiny else 1024)
    devices = jax.devices("cpu")
    out: dict[str, Any] = {
        "note": "CPU figure: the host devices share this machine's cores; not a TPU speed-up",
        "model": {**dims, "layers": 2, "seqs": batch.seqs, "context": batch.context},
    }
    params = init_params(spec)
    for n in sorted({1, min(8, len(devices))}):
        config = CacheConfig(
            tp_size=n, page_size=16, max_total_tokens=batch.seqs * batch.context, context_length=batch.context
        )
        mesh = make_serving_mesh(n, devices=devices) if n > 1 else None
        cache = build_kv_cache(spec, config, mesh=mesh)
        tokens, meta = decode_batch(batch, cache.plan.page_size, cache.plan.max_total_tokens)
        if mesh is None:
            pools, weights, step = cache.pools, params, make_step(spec)
        else:
            pools, weights = place_on_mesh(spec, cache.pools, params, mesh)
            step = make_sharded_step(spec, mesh, pools)
        state = {"pools": pools}

        def run(step: Any = step, weights: Any = weights, state: Any = state, inputs: Any = (tokens, meta)) -> None:
            state["pools"], next_tokens = step(state["pools"], weights, *inputs)
            jax.block_until_ready(next_tokens)

        out[f"devices_{n}_seconds"] = median_seconds(run, repeats=3 if tiny else 20, warmup=1 if tiny else 3)
    if "devices_8_seconds" in out:
        out["ratio_8_to_1"] = round(out["devices_8_seconds"] / out["devices_1_seconds"], 3)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="one model, small shapes, few repeats, no TPU compile")
    args = parser.parse_args(argv)
    models = {"llama-3-8b": "mha", "deepseek-v3": PLANNED_MODELS["deepseek-v3"]} if args.tiny else PLANNED_MODELS
    result = {
        "machine": machine(),
        "pool_bytes_per_device": {"planned": pool_bytes_per_device(models), "built": built_pool_bytes_per_device()},
        "tokens_per_device_budget": tokens_per_device_budget(models, 16 * GiB),
        "collectives_per_decode_layer": (
            {"measured": False, "why": "--tiny skips the TPU compiles"} if args.tiny else collectives_per_decode_layer()
        ),
        "step_time_cpu": step_time_cpu(args.tiny),
        "dp_routing": {f"dp{dp}": routing_hit_rates(dp) for dp in ((2,) if args.tiny else (2, 4))},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
