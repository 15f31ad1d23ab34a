"""DCP on the TP group's own chips: DeepSeek-V3's decode pool on a v5e-8 at ``--tp 8 --dcp 1/2/4/8``.

    python benchmarks/dcp_plan.py [--weights-bytes 40GiB]

Runs ``python -m kvjax plan --model deepseek-v3 --tpu v5e --chips 8 --tp 8 --dcp D --weights-bytes
W --json`` in this process for each ``D`` and prints one JSON object. DCP divides the TP group, as
in SGLang: the weights stay split over the 8 chips (``weights_per_chip`` is ``W / 8`` at every
``D``), and the MLA latent, which TP 8 replicates on every chip, is striped by token over ``D``
chips instead, so the pool grows by the stripe factor on the same chips and the same budget.

Per ``D``: ``pool_tokens`` (the allocator's striped pool), ``rows_per_device``, ``ratio`` (the pool
against ``D`` = 1) and ``goal`` (``D``, the full stripe factor), ``weights_fit`` (the chip's share of
the weights leaves room for the KV cache: the plan refuses otherwise), and, for contrast,
``weights_per_chip_if_replicated_over_dcp``: what a chip would hold were the DCP ranks extra
replicas of a TP ``8 / D`` group (kvjax's earlier meaning of ``--dcp``), and whether that fits.

``W`` is an assumed checkpoint size (default 40 GiB): DeepSeek-V3's released FP8 checkpoint (about
690 GB) does not fit a v5e-8 (8 x 16 GiB) at all, so the figure stands for a checkpoint that does,
to show the KV side of the trade with the weights subtracted. Plan arithmetic, no device.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvjax.chips import tpu_chip, weights_per_chip  # noqa: E402
from kvjax.cli import main as kvjax_main  # noqa: E402
from kvjax.cli.arg_types import parse_bytes  # noqa: E402

MODEL = "deepseek-v3"
TPU = "v5e"
CHIPS = 8
TP = 8
DCP_SIZES = (1, 2, 4, 8)
FRACTION = 0.9  # the plan's default mem_fraction_static


def plan_json(dcp: int, weights_bytes: int) -> dict[str, Any]:
    """``python -m kvjax plan ... --json`` at ``--dcp dcp``, parsed; raises on a refusal."""
    argv = ["plan", "--model", MODEL, "--tpu", TPU, "--chips", str(CHIPS), "--tp", str(TP), "--dcp", str(dcp)]
    argv += ["--weights-bytes", str(weights_bytes), "--json"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = kvjax_main(argv)
    if status != 0:
        raise RuntimeError(f"plan --dcp {dcp} exited {status}: {err.getvalue().strip()}")
    return json.loads(out.getvalue())


def run(weights_bytes: int) -> dict[str, Any]:
    usable = int(tpu_chip(TPU).hbm_bytes * FRACTION)
    rows: dict[str, Any] = {}
    base = None
    for dcp in DCP_SIZES:
        plan = plan_json(dcp, weights_bytes)
        tokens = plan["max_total_tokens"]
        base = tokens if base is None else base
        share = weights_per_chip(weights_bytes, TP)
        replicated = weights_per_chip(weights_bytes, TP // dcp)
        rows[f"tp{TP}_dcp{dcp}"] = {
            "pool_tokens": tokens,
            "rows_per_device": tokens // dcp,
            "alloc_page_size": plan["alloc_page_size"],
            "kv_budget_bytes_per_chip": plan["kv_budget_bytes"],
            "ratio": round(tokens / base, 4),
            "goal": dcp,
            "weights_per_chip": share,
            "weights_fit": share < usable,
            "weights_per_chip_if_replicated_over_dcp": replicated,
            "weights_fit_if_replicated_over_dcp": replicated < usable,
        }
    return {
        "model": MODEL,
        "slice": f"{TPU}-{CHIPS}",
        "tp": TP,
        "weights_bytes": weights_bytes,
        "usable_bytes_per_chip": usable,
        "weights_note": "an assumed checkpoint size: DeepSeek-V3's FP8 release does not fit a v5e-8",
        "by_dcp": rows,
        "full_stripe_factor_reached": all(r["ratio"] >= 0.999 * r["goal"] for r in rows.values()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights-bytes", type=parse_bytes, default=parse_bytes("40GiB"))
    args = parser.parse_args(argv)
    result = run(args.weights_bytes)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
