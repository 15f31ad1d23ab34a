"""Ragged paged attention: the decode roofline on paper, the kernel's expected fraction of it, CPU timings,
and whether the kernel compiles for TPU. Prints one JSON object.

Nothing here runs on a TPU. The figures are:

* ``decode_roofline``: Llama-3-8B decode (32 layers, 8 KV heads, head_dim 128, bf16): the KV bytes
  one step reads divided by the chip's HBM bandwidth (v5e 819 GB/s, v6e 1638 GB/s). A lower bound
  on the step's attention time (weights not counted).
* ``expected_fraction``: a paper model of this kernel's decode against that bound. Per grid step
  (``block_q`` = 8 sequences) the kernel streams KV blocks of 256 tokens (16 pages of 16) through a
  VMEM double buffer that runs across sequences, so a step costs about
  ``first_fetch + (n - 1) * max(dma_block, compute_block) + compute_block + step_overhead``.
  ``compute_block`` is the static schedule length of the compiled KV-block loop (bundles, read
  from the compiler's schedule dump when libtpu is importable; else the figures recorded when
  this file was written) at an assumed clock. DMA efficiency, latency, per-step overhead and the
  clocks are assumptions, listed in the output.
* ``cpu``: wall time of the jnp reference (the CPU path) at a small mixed batch, and of the
  kernel under the HLO interpreter there (a correctness tool, not a performance figure).
* ``tpu_compile``: ahead-of-time compiles for ``v5e:2x2`` and ``v6e:2x2`` at decode and prefill
  shapes, when libtpu is importable (libtpu locks a file per process: on a host with no TPU in
  use, ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` lets this run next to other JAX processes).
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Llama-3-8B attention.
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, ITEMSIZE, PAGE_SIZE = 32, 32, 8, 128, 2, 16
HBM_BYTES_PER_S = {"v5e": 819e9, "v6e": 1638e9}
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}
BATCHES = [1, 8, 64, 128, 256]
CONTEXTS = [512, 2048, 8192]

# Paper-model assumptions (not measured).
ASSUMED = {
    # Core clock, from peak bf16 FLOP/s over MXU MACs per cycle (v5e: 197 TF/s, 4 MXUs of 128x128;
    # v6e: 918 TF/s, 4 MXUs of 256x256).
    "clock_hz": {"v5e": 1.5e9, "v6e": 1.75e9},
    # Sustained fraction of HBM bandwidth reached by streams of 64 KiB page DMAs.
    "dma_efficiency": 0.9,
    # Issue-to-first-byte of the first fetch of a grid step, and the fixed cost of a grid step.
    "dma_latency_s": 1.0e-6,
    "grid_step_overhead_s": 0.35e-6,
}
# Bundles one full KV block costs (static schedule of the KV-block loop incl. its per-page DMA start
# and wait loops, see kv_block_loop_bundles) at the decode shape below, as read from the
# compiler's dump when this file was written (jax/libtpu of the project's pin). Used when libtpu
# is not importable here.
RECORDED_BUNDLES_PER_BLOCK = {"v5e": 2405, "v6e": 2067}
DECODE_SHAPE = dict(max_seqs=64, tokens=64, context=2048)
DECODE_BLOCK_KV_PAGES = 16  # the default tiling at DECODE_SHAPE: 256 keys per KV block
PREFILL_SHAPE = dict(max_seqs=4, tokens=2048, context=2048)


def kv_bytes_per_token() -> int:
    """K and V of one token over all layers: 32 * 2 * 8 * 128 * 2 B = 128 KiB."""
    return LAYERS * 2 * KV_HEADS * HEAD_DIM * ITEMSIZE


def expected_decode(chip: str, batch: int, context: int, bundles: int) -> dict[str, Any]:
    """Paper model of one decode step (all layers) on ``chip``; see the module docstring."""
    from pallas_kernels.ragged_paged_attention import default_block_sizes

    pages_per_seq = -(-context // PAGE_SIZE)
    block_q, block_kv_pages = default_block_sizes(batch, batch, Q_HEADS // KV_HEADS, PAGE_SIZE, pages_per_seq)
    block_tokens = block_kv_pages * PAGE_SIZE
    bandwidth = HBM_BYTES_PER_S[chip]
    layer_bytes_per_token = kv_bytes_per_token() // LAYERS
    dma_block = block_tokens * layer_bytes_per_token / bandwidth / ASSUMED["dma_efficiency"]
    compute_block = bundles / ASSUMED["clock_hz"][chip]
    blocks_per_seq = -(-context // block_tokens)
    steps = -(-batch // block_q)
    step_time = 0.0
    for step in range(steps):
        seqs = min(block_q, batch - step * block_q)
        n = seqs * blocks_per_seq
        step_time += (
            ASSUMED["dma_latency_s"]
            + dma_block
            + (n - 1) * max(dma_block, compute_block)
            + compute_block
            + ASSUMED["grid_step_overhead_s"]
        )
    roofline = batch * context * layer_bytes_per_token / bandwidth
    return {
        "expected_fraction": round(roofline / step_time, 3),
        "expected_ms_per_step": round(step_time * LAYERS * 1e3, 3),
        "bound": "compute" if compute_block > dma_block else "dma",
    }


def decode_roofline(bundles: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            kv_bytes = batch * context * kv_bytes_per_token()
            row: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes_per_step": kv_bytes}
            for chip, bandwidth in HBM_BYTES_PER_S.items():
                row[chip] = {
                    "roofline_ms_per_step": round(kv_bytes / bandwidth * 1e3, 3),
                    **expected_decode(chip, batch, context, bundles[chip]),
                }
            rows.append(row)
    return rows


def cpu_timings() -> dict[str, Any]:
    """The reference (the CPU path) and the HLO-interpreted kernel on a small mixed batch, bf16."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks._common import machine, median_seconds
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

    rng = np.random.default_rng(0)
    q_lens = [1] * 8 + [32]  # 8 decode tokens and one 32-token extend chunk
    kv_lens = [int(x) for x in rng.integers(16, 256, 8)] + [160]
    max_seqs, pages_per_seq, q_heads, kv_heads, dim, ps = 10, 16, 8, 2, 128, 16
    num_pages = max_seqs * pages_per_seq
    kv = jnp.asarray(rng.standard_normal((num_pages + 1, ps, 2 * kv_heads, dim)), jnp.bfloat16)
    table = np.zeros((max_seqs, pages_per_seq), np.int32)
    table[: len(q_lens)] = 1 + rng.permutation(num_pages)[: len(q_lens) * pages_per_seq].reshape(len(q_lens), -1)
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    lens = np.zeros(max_seqs, np.int32)
    lens[: len(kv_lens)] = kv_lens
    total = 48
    q = jnp.asarray(rng.standard_normal((total, q_heads, dim)), jnp.bfloat16)
    args = (q, kv, jnp.asarray(lens), jnp.asarray(table), jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32))
    reference = jax.jit(ragged_paged_attention_reference)
    kernel = jax.jit(functools.partial(ragged_paged_attention, interpret=True))
    ref_s = median_seconds(lambda: reference(*args).block_until_ready(), repeats=10)
    kernel_s = median_seconds(lambda: kernel(*args).block_until_ready(), repeats=5, warmup=1)
    err = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32) - reference(*args).astype(jnp.float32))))
    return {
        "shape": {
            "q_tokens": total,
            "live_tokens": sum(q_lens),
            "seqs": len(q_lens),
            "kv_tokens": sum(kv_lens),
            "q_heads": q_heads,
            "kv_heads": kv_heads,
            "head_dim": dim,
            "page_size": ps,
            "dtype": "bfloat16",
        },
        "reference_ms": round(ref_s * 1e3, 3),
        "kernel_hlo_interpreter_ms": round(kernel_s * 1e3, 3),
        "kernel_vs_reference_max_abs_err": err,
        "machine": machine(),
    }


def _shape_args(mesh: Any, max_seqs: int, tokens: int, context: int) -> tuple[Any, ...]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    pages_per_seq = context // PAGE_SIZE
    shapes = [
        ((tokens, Q_HEADS, HEAD_DIM), jnp.bfloat16),
        ((max_seqs * pages_per_seq + 1, PAGE_SIZE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16),
        ((max_seqs,), jnp.int32),
        ((max_seqs, pages_per_seq), jnp.int32),
        ((max_seqs + 1,), jnp.int32),
        ((1,), jnp.int32),
    ]
    return tuple(jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes)


def _compile(topology: str, shape: dict[str, int]) -> Any:
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    devices = np.asarray(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices).reshape(-1)
    mesh = Mesh(devices[:1], ("x",))
    fn = functools.partial(ragged_paged_attention, sm_scale=HEAD_DIM**-0.5)
    return jax.jit(fn).trace(*_shape_args(mesh, **shape)).lower().compile()


def tpu_compiles() -> dict[str, Any]:
    """Compile decode and prefill for each chip (one chip of the 2x2 slice); record success and time."""
    out: dict[str, Any] = {}
    for _chip, topology in TOPOLOGIES.items():
        for name, shape in (("decode_64x1_ctx2048", DECODE_SHAPE), ("prefill_4x512_ctx2048", PREFILL_SHAPE)):
            start = time.perf_counter()
            try:
                compiled = _compile(topology, shape)
                ok, detail = True, "tpu_custom_call" in compiled.as_text()
            except Exception as e:  # report, don't crash: the JSON says what failed
                ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            out[f"{topology} {name}"] = {
                "compiled": ok,
                "seconds": round(time.perf_counter() - start, 2),
                **({"kernel_in_hlo": detail} if ok else {"error": detail}),
            }
    return out


_CONTROL = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(LB|LH|LE|PB|PF|CT):\s*(>*)")


def kv_block_loop_bundles(bundles_text: str, inner_trips: int) -> int | None:
    """Bundles one full KV block costs, from a final-bundles dump of the kernel.

    The KV-block loop is the innermost loop that issues matmuls; its body holds two inner loops
    (start the next block's page DMAs, wait for this block's), each run once per page: the
    result is the loop's static length plus ``(inner_trips - 1)`` more passes of each inner loop.
    Control lines look like ``0x10a LB: >>> { ... }`` (address, kind, nesting depth).
    """
    lines = bundles_text.splitlines()
    marks = []
    for i, line in enumerate(lines):
        m = _CONTROL.match(line)
        if m:
            marks.append((i, int(m.group(1), 0), m.group(2), len(m.group(3))))

    def end_of(k: int) -> tuple[int, int] | None:
        depth = marks[k][3]
        return next(((ln, a) for ln, a, _, d in marks[k + 1 :] if d < depth), None)

    best: tuple[int, int] | None = None  # (depth, index into marks)
    for k, (line_no, _, kind, depth) in enumerate(marks):
        end = end_of(k) if kind == "LB" else None
        if end is None or not any("vmatpush" in line or ".mxu" in line for line in lines[line_no : end[0]]):
            continue
        if best is None or depth > best[0]:
            best = (depth, k)
    if best is None:
        return None
    depth, k = best
    end_line, end_addr = end_of(k)
    total = end_addr - marks[k][1]
    for j in range(k + 1, len(marks)):
        line_no, addr, kind, d = marks[j]
        if line_no >= end_line:
            break
        inner_end = end_of(j) if kind == "LB" and d == depth + 1 else None
        if inner_end is not None:
            total += (inner_trips - 1) * (inner_end[1] - addr)
    return total


def static_bundles(chip: str) -> int | None:
    """Compile the decode shape in a child process with the compiler's schedule dump on; parse it."""
    with tempfile.TemporaryDirectory() as dump:
        env = dict(
            os.environ,
            LIBTPU_INIT_ARGS=f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true "
            "--xla_jf_dump_llo_pass_label_regex=final_bundles",
        )
        code = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r}); "
            "from benchmarks.attention import _compile, DECODE_SHAPE; "
            f"_compile({TOPOLOGIES[chip]!r}, DECODE_SHAPE)"
        )
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=600, check=False)
        pattern = os.path.join(dump, "**", "*ragged_paged_attention*final_bundles*")
        files = [
            f for f in glob.glob(pattern, recursive=True) if "schedule-analysis" not in os.path.basename(f)
        ]  # the bundles, not the summary
        if not files:
            return None
        with open(files[0]) as f:
            return kv_block_loop_bundles(f.read(), DECODE_BLOCK_KV_PAGES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cpu", action="store_true", help="skip the CPU timings")
    args = parser.parse_args()

    has_libtpu = importlib.util.find_spec("libtpu") is not None
    bundles, source = dict(RECORDED_BUNDLES_PER_BLOCK), "recorded when this file was written"
    if has_libtpu:
        measured = {chip: static_bundles(chip) for chip in TOPOLOGIES}
        if all(measured.values()):
            bundles, source = measured, "read from this run's compile (static schedule dump)"
    result: dict[str, Any] = {
        "benchmark": "ragged_paged_attention",
        "ran_on_tpu": False,
        "note": (
            "Roofline and expected fractions are figures on paper: nothing ran on a TPU. Expected fraction = "
            "roofline time / modelled kernel time, with the kernel's compute per KV block taken from the "
            "compiled static schedule and the assumptions listed."
        ),
        "model": {
            "name": "Llama-3-8B",
            "layers": LAYERS,
            "q_heads": Q_HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "page_size": PAGE_SIZE,
            "kv_bytes_per_token_all_layers": kv_bytes_per_token(),
        },
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "kernel_decode_tiling": {"block_q_tokens": 8, "block_kv_tokens": 256, "kv_block_bytes_per_layer": 256 * 4096},
        "static_bundles_per_kv_block": {"value": bundles, "source": source},
        "assumptions": ASSUMED,
        "anchor": "tpu-inference RPA v3 paper: up to 86% HBM bandwidth utilisation in decode (Llama-3-8B, TPU7x)",
        "decode_roofline": decode_roofline(bundles),
    }
    if not args.skip_cpu:
        result["cpu"] = cpu_timings()
    result["tpu_compile"] = tpu_compiles() if has_libtpu else {"skipped": "libtpu not importable"}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
