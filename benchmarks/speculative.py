"""Speculative decoding (STANDALONE) on the tiny model: acceptance, target steps, rollback cost.

The target is the built-in ``tiny`` preset (two layers, random weights from seed 0). Three drafts:

* ``agrees``: a checkpoint equal to the target (the same weights as a draft model): it must
  accept every proposal (acceptance 1.0, ``k + 1`` tokens per target step but at a request's end);
* ``first_layer``: a one-layer model with the target's embedding, first layer and head (agrees
  part of the time);
* ``random``: an unrelated one-layer model (seed 7): it agrees about as often as chance.

Each run serves the same prompts (page size 16, no eviction) through the plain loop (overlap
off) and the speculative loop, asserts that the tokens are identical, and reports per draft:
``acceptance_rate`` (accepted over proposed draft tokens), ``accept_length`` (tokens per request
per target verify step, the bonus token included), ``target_steps_per_token`` (target forwards,
prefill and verify, per generated token) next to the plain loop's, and the rollback's host cost
(``rollback_us_per_round``: choosing and freeing the rejected slots, per round, microseconds;
``rolled_back_slots_per_round``). Wall times are CPU times of a tiny model dominated by dispatch
and compilation; the step counts are the figures that carry over.

Run: ``python benchmarks/speculative.py [--steps K] [--new-tokens N]`` (JSON on stdout; about a
minute on CPU, mostly compiling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine  # noqa: E402
from kvjax import CacheConfig, ModelSpec, build_kv_cache  # noqa: E402
from kvjax.serve.model import init_params  # noqa: E402
from kvjax.serve.model_config import model_config_from_spec  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from kvjax.serve.speculative import DraftDecoding, speculative_scheduler  # noqa: E402

PAGE_SIZE = 16
CONTEXT = 256
PROMPTS = 4


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(0, 256, 24)]
    return [system + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 9, 3, 12)][:PROMPTS]


def _serve(sched: Scheduler, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    reqs = [ServingReq(i, p, max_new_tokens=new_tokens) for i, p in enumerate(prompts)]
    sched.run(reqs)
    assert sched.leak_free()
    return [r.output_ids for r in reqs]


def run(steps: int, new_tokens: int) -> dict[str, Any]:
    spec = ModelSpec.preset("tiny")
    config = model_config_from_spec(spec)
    params = init_params(config)
    small = dataclasses.replace(spec, name="tiny-1-layer", num_hidden_layers=1, layer_kinds=spec.layer_kinds[:1])
    small_config = model_config_from_spec(small)
    drafts = {
        "agrees": (spec, config, params),
        "first_layer": (
            small,
            small_config,
            {"model": {k: v for k, v in params["model"].items() if k != "layers_1"}, "lm_head": params["lm_head"]},
        ),
        "random": (small, small_config, init_params(small_config, seed=7)),
    }
    prompts = _prompts()
    settings = dict(page_size=PAGE_SIZE, context_length=CONTEXT, max_total_tokens=4096, chunked_prefill_size=64)
    plain = Scheduler(config, build_kv_cache(spec, CacheConfig(**settings)), params, overlap=False)
    expected = _serve(plain, prompts, new_tokens)
    generated = plain.stats.generated_tokens
    plain_steps = plain.stats.prefill_steps + plain.stats.decode_steps
    report: dict[str, Any] = {
        "model": "tiny",
        "num_steps": steps,
        "requests": len(prompts),
        "new_tokens": new_tokens,
        "plain": {"target_steps": plain_steps, "target_steps_per_token": round(plain_steps / generated, 4)},
    }
    for name, (draft_spec, draft_config, draft_params) in drafts.items():
        cache = build_kv_cache(
            spec,
            CacheConfig(
                **settings,
                speculative_algorithm="STANDALONE",
                speculative_num_steps=steps,
                speculative_num_draft_tokens=steps + 1,
            ),
            draft_spec=draft_spec,
        )
        sched = speculative_scheduler(
            config, cache, params, draft=draft_config, draft_params=draft_params, num_steps=steps
        )
        assert _serve(sched, prompts, new_tokens) == expected, f"{name}: tokens differ from the plain loop"
        sp = _draft(sched).stats
        target_steps = sched.stats.prefill_steps + sched.stats.decode_steps
        report[name] = {
            "acceptance_rate": round(sp.acceptance_rate, 4),
            "accept_length": round(sp.accept_length, 3),
            "target_steps": target_steps,
            "target_steps_per_token": round(target_steps / sched.stats.generated_tokens, 4),
            "target_steps_vs_plain": round(target_steps / plain_steps, 4),
            "rounds": sp.rounds,
            "rolled_back_slots_per_round": round(sp.rolled_back_slots / sp.rounds, 3),
            "rollback_us_per_round": round(1e6 * sp.rollback_seconds / sp.rounds, 2),
            "tokens_identical_to_plain": True,
        }
    assert report["agrees"]["acceptance_rate"] == 1.0, "a draft equal to the target must accept everything"
    report["machine"] = machine()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="draft tokens per round (--speculative-num-steps)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    args = parser.parse_args()
    print(json.dumps(run(args.steps, args.new_tokens), indent=2))


if __name__ == "__main__":
    main()


def _draft(sched: Scheduler) -> DraftDecoding:
    """The scheduler's draft-model proposer."""
    assert isinstance(sched.proposer, DraftDecoding)
    return sched.proposer
