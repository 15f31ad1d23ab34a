"""EAGLE-style speculative decoding with DeepSeek's MTP (NextN) layer against STANDALONE drafts,
on the tiny DeepSeek-V2 preset: acceptance and target steps per generated token.

The target is the built-in ``deepseek-tiny`` preset (MLA, a dense first layer then MoE; random
weights from seed 0) with one MTP layer (``num_nextn_predict_layers: 1``). Drafts:

* EAGLE ``mtp_random``: the MTP layer with random weights (kvjax's init, seed 7): what an untrained
  layer proposes (about chance);
* EAGLE ``mtp_repeat``: ``eh_proj`` passes the hidden state alone and the decoder layer adds nothing,
  so the layer's logits are the target's at the position before: it proposes the round's last
  token ``k`` times (right exactly where the target repeats itself);
* EAGLE ``mtp_embedding`` on a *bigram* target (the same model with every attention ``o_proj`` and
  MLP ``down_proj`` zeroed, so its next token depends on the last token alone): ``eh_proj`` passes
  the normed embedding alone and the decoder layer adds nothing, so the layer computes the
  target's own next-token function and every proposal is accepted (the chain's upper bound, as
  STANDALONE ``agrees``);
* STANDALONE ``agrees``: the target as its own draft (accepts everything);
* STANDALONE ``first_layer``: a one-layer model with the target's embedding, first layer, norm and
  head.

Each run serves the same prompts (page size 16, no eviction) through the plain loop (overlap off)
and the speculative loop, asserts the tokens are identical, and reports per draft
``acceptance_rate`` (accepted over proposed draft tokens), ``accept_length`` (tokens per request
per target verify step, bonus included), ``target_steps_per_token`` (target forwards, prefill and
verify, per generated token) next to the plain loop's. Random tiny weights make the numbers a
plumbing check, not a forecast: a trained MTP layer (DeepSeek-V3 reports 85-90 % acceptance of
the second token) is what makes EAGLE pay.

Run: ``python benchmarks/speculative_eagle.py [--steps K] [--new-tokens N]`` (JSON on stdout; a
few minutes on CPU, mostly compiling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine  # noqa: E402
from kvjax import CacheConfig, ModelSpec, build_kv_cache  # noqa: E402
from kvjax.serve.model import init_params  # noqa: E402
from kvjax.serve.model_config import model_config_from_spec  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from kvjax.serve.speculative import DraftDecoding, speculative_scheduler  # noqa: E402
from kvjax.serve.speculative.eagle import eagle_scheduler  # noqa: E402
from kvjax.serve.speculative.nextn import nextn_param_shapes, with_shared_weights  # noqa: E402

PAGE_SIZE = 16
CONTEXT = 256


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(0, vocab, 24)]
    return [system + [int(t) for t in rng.integers(0, vocab, n)] for n in (5, 9, 3, 12)]


def _serve(sched: Scheduler, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    reqs = [ServingReq(i, p, max_new_tokens=new_tokens) for i, p in enumerate(prompts)]
    sched.run(reqs)
    assert sched.leak_free()
    return [r.output_ids for r in reqs]


def _silenced(tree: Any) -> Any:
    """``tree`` with every attention ``o_proj`` and MLP ``down_proj`` weight zeroed (a layer adds nothing)."""

    def zero(path: tuple[Any, ...], leaf: Any) -> Any:
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        silent = name.endswith("o_proj/weight") or name.endswith("down_proj/weight")
        return jnp.zeros(leaf.shape, leaf.dtype) if silent else leaf

    return jax.tree_util.tree_map_with_path(zero, tree)


def _mtp_weights(config: Any, target_params: Any, *, mode: str) -> dict[str, Any]:
    """The MTP layer's weights: kvjax's random init (seed 7; norms 1), or the repeat or the
    embedding layer (module docstring)."""
    shapes = nextn_param_shapes(config)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(shapes))))
    hidden = config.hidden_size

    def draw(path: tuple[Any, ...], leaf: Any) -> Any:
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if name.endswith("norm/weight"):
            return jnp.ones(leaf.shape, leaf.dtype)
        if mode != "random" and name == "eh_proj/weight":
            halves = [jnp.eye(hidden), jnp.zeros((hidden, hidden))]
            return jnp.concatenate(halves[::-1] if mode == "repeat" else halves, axis=1).astype(leaf.dtype)
        return (0.02 * jax.random.normal(next(keys), leaf.shape)).astype(leaf.dtype)

    own = jax.tree_util.tree_map_with_path(draw, shapes)
    if mode != "random":
        own = _silenced(own)
    own = {k: v for k, v in own.items() if k not in ("embed_tokens", "lm_head")}
    return with_shared_weights(own, config, target_params)


def _row(sched: Scheduler, proposer: DraftDecoding, plain_steps: int) -> dict[str, Any]:
    sp = proposer.stats
    target_steps = sched.stats.prefill_steps + sched.stats.decode_steps
    return {
        "acceptance_rate": round(sp.acceptance_rate, 4),
        "accept_length": round(sp.accept_length, 3),
        "target_steps": target_steps,
        "target_steps_per_token": round(target_steps / sched.stats.generated_tokens, 4),
        "target_steps_vs_plain": round(target_steps / plain_steps, 4),
        "rounds": sp.rounds,
        "tokens_identical_to_plain": True,
    }


def run(steps: int, new_tokens: int) -> dict[str, Any]:
    spec = dataclasses.replace(ModelSpec.preset("deepseek-tiny"), num_nextn_predict_layers=1)
    config = model_config_from_spec(spec)
    params = init_params(config)
    prompts = _prompts(spec.vocab_size)
    settings = dict(page_size=PAGE_SIZE, context_length=CONTEXT, max_total_tokens=4096, chunked_prefill_size=64)
    plain = Scheduler(config, build_kv_cache(spec, CacheConfig(**settings)), params, overlap=False)
    expected = _serve(plain, prompts, new_tokens)
    generated = plain.stats.generated_tokens
    plain_steps = plain.stats.prefill_steps + plain.stats.decode_steps
    speculative = dict(speculative_num_steps=steps, speculative_num_draft_tokens=steps + 1)
    report: dict[str, Any] = {
        "model": "deepseek-tiny + one MTP layer",
        "num_steps": steps,
        "topk": 1,
        "requests": len(prompts),
        "new_tokens": new_tokens,
        "plain": {"target_steps": plain_steps, "target_steps_per_token": round(plain_steps / generated, 4)},
    }
    bigram = _silenced(params)
    bigram_plain = Scheduler(config, build_kv_cache(spec, CacheConfig(**settings)), bigram, overlap=False)
    bigram_expected = _serve(bigram_plain, prompts, new_tokens)
    bigram_steps = bigram_plain.stats.prefill_steps + bigram_plain.stats.decode_steps
    report["plain (bigram target)"] = {
        "target_steps": bigram_steps,
        "target_steps_per_token": round(bigram_steps / bigram_plain.stats.generated_tokens, 4),
    }
    for name, mode, target, want, base in (
        ("mtp_random", "random", params, expected, plain_steps),
        ("mtp_repeat", "repeat", params, expected, plain_steps),
        ("mtp_embedding (bigram target)", "embedding", bigram, bigram_expected, bigram_steps),
    ):
        cache = build_kv_cache(spec, CacheConfig(**settings, speculative_algorithm="NEXTN", **speculative))
        draft = _mtp_weights(config, target, mode=mode)
        sched = eagle_scheduler(config, cache, target, draft_params=draft, num_steps=steps)
        assert _serve(sched, prompts, new_tokens) == want, f"EAGLE {name}: tokens differ from the plain loop"
        assert isinstance(sched.proposer, DraftDecoding)
        report[f"EAGLE {name}"] = _row(sched, sched.proposer, base)
    small = dataclasses.replace(
        spec, name="deepseek-tiny-1-layer", num_hidden_layers=1, layer_kinds=spec.layer_kinds[:1]
    )
    small = dataclasses.replace(small, num_nextn_predict_layers=0)
    first_layer = {"model": {k: v for k, v in params["model"].items() if k in ("embed_tokens", "layers_0", "norm")}}
    first_layer["lm_head"] = params["lm_head"]
    standalone_spec = dataclasses.replace(spec, num_nextn_predict_layers=0)
    for name, (draft_spec, draft_params) in {
        "agrees": (standalone_spec, params),
        "first_layer": (small, first_layer),
    }.items():
        cache = build_kv_cache(
            spec, CacheConfig(**settings, speculative_algorithm="STANDALONE", **speculative), draft_spec=draft_spec
        )
        sched = speculative_scheduler(
            config,
            cache,
            params,
            draft=model_config_from_spec(draft_spec),
            draft_params=draft_params,
            num_steps=steps,
        )
        assert _serve(sched, prompts, new_tokens) == expected, f"STANDALONE {name}: tokens differ from the plain loop"
        assert isinstance(sched.proposer, DraftDecoding)
        report[f"STANDALONE {name}"] = _row(sched, sched.proposer, plain_steps)
    assert report["STANDALONE agrees"]["acceptance_rate"] == 1.0, "a draft equal to the target must accept everything"
    assert report["EAGLE mtp_embedding (bigram target)"]["acceptance_rate"] == 1.0, "the bigram's own function"
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
