"""DeepSeek-V3's serving composition on a 16-chip TPU slice: collective bytes per layer against the
minimum, and per-chip bytes against the chip's HBM, read from the compiled programs (no TPU).

    .venv-tpu/bin/python benchmarks/composed_collectives.py [--topology v5p:2x2x4 ...]

Needs libtpu (the ``tpu`` extra, in an environment of its own: ``.ci/tpu_compile.sh`` makes
``.venv-tpu``); without it the JSON says so. Set ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` when another
process has libtpu loaded. Each part compiles in half a minute to two minutes on two CPU cores
(about 6 minutes for everything).

For each topology (default ``v5p:2x2x4`` and ``v6e:4x4``, 16 chips each) and each part of the
composition (``kvjax.serve.abstract_composed``; DeepSeek-V3's layer sizes, one dense and one MoE
layer and the MTP layer, weights as shapes only): ``dp_step``, the DP-attention decode step at dp 2
x tp 8; ``dp_eagle_round``, the composed step: every DP rank's MTP speculative round in one program
at dp 2 x tp 8 (what each decode step of the composition runs); ``eagle_round``, the same round at
tp 16 without DP attention, for comparison. One JSON object per part with:

* ``collectives``: bytes per execution one chip's collectives produce, by where (``"0"``, ``"1"``:
  the target's layers; ``"mtp"``: the MTP layer, its draft steps counted per step; ``"outside"``)
  and kind (``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``,
  ``collective-permute``), read from the compiled program (``kvjax.serve.compiled_step``);
* ``minimum``: the same for the minimum: Megatron's two all-reduces of ``[tokens, hidden]`` bf16
  per layer under TP. DP attention's MLP runs per rank over the rank's 8 chips (kvjax's DP step
  gathers no tokens across ranks), so its minimum is one rank's tokens' two all-reduces over 8
  chips; the round's draft steps each move the MTP layer's two all-reduces of the draft bucket
  (``NUM_STEPS`` times), the draft's pass over the verified tokens none (only its KV write is
  used); outside the layers the DP step gathers every rank's sampled tokens to every host of a
  multi-host slice (XLA may do that gather as an all-reduce of zero-padded rows: same bytes), the
  DP round every rank's proposals and greedy tokens;
* ``per_layer_bytes`` / ``per_layer_minimum``: the target layers' average;
* ``ratio``: the part's total collective bytes over the minimum's;
* ``per_chip``: weights, pools (and the round's hidden-state store), other arguments and
  temporaries in bytes (``memory_analysis``), their sum and its fraction of the chip's HBM, and the
  whole model's weights per chip at the same layout (61 layers, the real vocabulary);
* ``compile_seconds``;

or, where the compiler refuses the program because it does not fit the chip,
``{"compiled": false, "why": ...}`` with the compiler's message (its bytes needed and the HBM).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine  # noqa: E402


def part_report(name: str, topology: str) -> dict[str, Any]:
    """The JSON object of part ``name`` on ``topology`` (module docstring)."""
    import jax

    from kvjax.serve.abstract_composed import LAYERS, collective_bytes, compile_part, full_model_weight_bytes

    try:
        part = compile_part(name, topology)
    except jax.errors.JaxRuntimeError as error:
        message = str(error).splitlines()[0]
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        return {"compiled": False, "why": message}
    found = collective_bytes(part)
    memory = part.memory

    def total(table: dict[str, dict[str, int]]) -> int:
        return sum(sum(kinds.values()) for kinds in table.values())

    layers = [str(n) for n in range(LAYERS)]
    used = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    return {
        "compiled": True,
        "compile_seconds": round(part.seconds, 1),
        "tp_group_chips": part.group_size,
        "collectives": found,
        "minimum": part.minimum,
        "per_layer_bytes": sum(sum(found[n].values()) for n in layers) // LAYERS,
        "per_layer_minimum": sum(sum(part.minimum[n].values()) for n in layers) // LAYERS,
        "ratio": round(total(found) / total(part.minimum), 4) if total(part.minimum) else None,
        "per_chip": {
            "weights": part.weight_bytes,
            "pools": part.pool_bytes,
            "other_arguments": memory.argument_size_in_bytes - part.weight_bytes - part.pool_bytes,
            "temporaries": memory.temp_size_in_bytes,
            "total": used,
            "hbm": part.hbm_bytes,
            "fraction_of_hbm": round(used / part.hbm_bytes, 4),
            "whole_model_weights": full_model_weight_bytes(part),
        },
    }


def run(topologies: list[str]) -> dict[str, Any]:
    """Every part on every topology (module docstring)."""
    from kvjax.serve.abstract_composed import CONTEXT, LAYERS, NUM_STEPS, PARTS, SEQS

    out: dict[str, Any] = {
        "model": f"DeepSeek-V3 layer sizes, {LAYERS} layers (layer 0 dense, layer 1 MoE) + its MTP layer (MoE)",
        "batch": {"seqs_per_rank": SEQS, "context": CONTEXT, "draft_tokens_per_round": NUM_STEPS},
    }
    for topology in topologies:
        out[topology] = {name: part_report(name, topology) for name in PARTS}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from kvjax.serve.abstract_composed import TOPOLOGIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", action="append", help=f"16-chip TPU topologies (default: {list(TOPOLOGIES)})")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("libtpu") is None:
        result: dict[str, Any] = {"measured": False, "why": "libtpu is not installed here: run with the tpu extra"}
    else:
        import jax

        jax.config.update("jax_enable_compilation_cache", False)  # deviceless executables cannot be reloaded
        result = run(args.topology or list(TOPOLOGIES))
    result["machine"] = machine()
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
