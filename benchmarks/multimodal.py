"""Multimodal benchmark (host side): prints one JSON object.

    python benchmarks/multimodal.py [--tiny] [--no-encoder]

* ``hash``: the cost of an image's content hash (``kvjax.multimodal.hash_item``) at the pixel
  shapes LLaVA-1.5 (one 336 x 336 image, float32) and LLaVA-NeXT (5 tiles of 336 x 336) feed their
  encoder, ms per image and MB/s; beside it, unless ``--no-encoder``, the time of the encoder on
  the same image: Transformers' ``CLIPVisionModel`` at CLIP ViT-L/14-336's shape (random weights,
  float32, PyTorch on this machine's CPU), so the two are CPU figures of the same machine.
* ``agent_loop``: a screenshot-per-turn agent loop, the issue's workload, through a radix tree
  with image-aware keys (``pad_input_ids``) and the embedding cache: ``agents`` agents take turns;
  each turn's prompt is a system prompt, then the agent's last ``window`` screenshots (576 tokens
  each, LLaVA-1.5's count) with their text, then the new instruction. ``sliding_window``: once
  an agent has more than ``window`` screenshots the oldest drops out, so its prompt's prefix
  changes every turn and the tree reuses only the system prompt; the screenshots still in the
  window are the embedding cache's hits. ``full_history``: every screenshot stays, the tree
  reuses the history's KV, and the last turn's screenshot, whose last page it shares with the
  new text (page size 16), is the embedding cache's hit. An item whose positions all lie inside
  the matched prefix needs no encoder (SGLang skips it); every other item is looked up in the
  embedding cache (an entry of 576 x 4096 bf16 = 4.5 MiB, LLaVA-1.5-7B's projector output) and
  encoded on a miss. Reported per cache size (MiB): encoder runs, embedding-cache hits, misses,
  evictions and hit rate, the prefill tokens the tree saved, and (with the encoder timed) the
  encoder seconds left and saved against encoding every image of every prompt. The tree is
  unbounded here (no device eviction), so the figures isolate the two caches' roles.

CPU figures on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from kvjax.multimodal import EmbeddingCache, MultimodalItem, hash_item, pad_input_ids  # noqa: E402
from kvjax.radix import RadixCache  # noqa: E402

IMG = 32000  # LLaVA-1.5's <image> id
PREP = {"crop_size": 336, "image_mean": [0.4815, 0.4578, 0.4082], "image_std": [0.2686, 0.2613, 0.2758]}


class _Embedding:
    """A stand-in for an encoder output: only its size matters to the cache."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _median_ms(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def hash_figures(tiny: bool, encoder: bool) -> dict[str, Any]:
    """ms per image of the hash (and of the encoder), by pixel shape."""
    side = 64 if tiny else 336
    shapes = {"llava_1_5": (3, side, side), "llava_next_5_tiles": (5, 3, side, side)}
    out: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        pixels = rng.standard_normal(shape).astype(np.float32)
        ms = _median_ms(lambda p=pixels: hash_item(p, preprocessing=PREP), 5 if tiny else 21)
        out[name] = {"shape": list(shape), "mb": round(pixels.nbytes / 1e6, 3), "hash_ms": round(ms, 3)}
        out[name]["hash_mb_per_s"] = round(pixels.nbytes / 1e6 / (ms / 1e3), 1)
    if encoder:
        enc_ms = encoder_ms(side, tiny)
        one = out["llava_1_5"]
        one["encoder_ms"] = round(enc_ms, 1)
        one["hash_over_encoder"] = round(one["hash_ms"] / enc_ms, 5)
        tower = "a 2-layer 64-wide tower" if tiny else "ViT-L/14-336 shape"
        one["encoder"] = f"CLIPVisionModel, {tower}, float32"
    return out


def encoder_ms(side: int, tiny: bool) -> float:
    """ms of one image through Transformers' CLIP vision tower (random weights) on the CPU."""
    # This folder holds a ``kernels.py`` that would shadow the package of that name Transformers imports.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    if tiny:
        config = CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=side,
            patch_size=16,
        )
    else:
        config = CLIPVisionConfig(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=side,
            patch_size=14,
            projection_dim=768,
        )
    torch.manual_seed(0)
    model = CLIPVisionModel(config).eval()
    pixels = torch.randn(1, 3, side, side)

    def run() -> None:
        with torch.no_grad():
            model(pixel_values=pixels, output_hidden_states=True)

    return _median_ms(run, 3 if tiny else 5)


def _turn_prompt(
    system: list[int], shots: list[tuple[int, list[int]]], instruction: list[int], image_tokens: int
) -> tuple[list[int], list[MultimodalItem]]:
    """The padded prompt of one turn and its items: system, (text, screenshot) per shot, instruction."""
    ids = list(system)
    items = []
    for image_hash, text in shots:
        ids += text
        items.append(MultimodalItem(image_hash, len(ids), len(ids) + image_tokens))
        ids += [IMG] * image_tokens
    ids += instruction
    return pad_input_ids(ids, items, IMG), items


def agent_loop(tiny: bool, cache_mib: list[int], window: int | None) -> dict[str, Any]:
    """The agent-loop figures per embedding-cache size (module docstring); ``window``: the
    screenshots a prompt keeps (None: all of them)."""
    agents, turns = (2, 5) if tiny else (8, 16)
    window = window or turns
    image_tokens, hidden, page_size = 576, 4096, 16
    emb_bytes = image_tokens * hidden * 2
    rng = np.random.default_rng(1)
    system = rng.integers(1, 32000, 256).tolist()
    # every agent's turns, interleaved round-robin: (agent, turn)
    schedule = [(a, t) for t in range(turns) for a in range(agents)]
    shots_text = {(a, t): rng.integers(1, 32000, 24).tolist() for a in range(agents) for t in range(turns)}
    instruction = {(a, t): rng.integers(1, 32000, 40).tolist() for a in range(agents) for t in range(turns)}
    screenshot = {(a, t): 10**12 + 1000 * a + t for a in range(agents) for t in range(turns)}  # distinct hashes
    results = []
    for mib in cache_mib:
        tree = RadixCache(page_size=page_size)
        cache: EmbeddingCache[_Embedding] = EmbeddingCache(mib * 2**20)
        prompt_tokens = tree_hit_tokens = encoder_runs = items_in_prefix = 0
        for a, t in schedule:
            shots = [(screenshot[a, s], shots_text[a, s]) for s in range(max(0, t - window + 1), t + 1)]
            ids, items = _turn_prompt(system, shots, instruction[a, t], image_tokens)
            matched = tree.match_prefix(ids[:-1]).prefix_len
            prompt_tokens += len(ids)
            tree_hit_tokens += matched
            for item in items:
                if item.end <= matched:
                    items_in_prefix += 1  # its KV is reused: no encoder, no lookup
                    continue
                _, hit = cache.get_or_encode(item.hash, lambda: _Embedding(emb_bytes))
                encoder_runs += not hit
            aligned = len(ids) // page_size * page_size
            tree.insert(ids[:aligned], np.arange(aligned, dtype=np.int64))
            cache.check_invariants()
        s = cache.stats()
        results.append(
            {
                "cache_mib": mib,
                "entries_fit": (mib * 2**20) // emb_bytes,
                "encoder_runs": encoder_runs,
                "embedding_hits": s.hits,
                "embedding_misses": s.misses,
                "evictions": s.evictions,
                "hit_rate": round(s.hit_rate, 3),
                "items_reused_from_the_tree": items_in_prefix,
                "prompt_tokens": prompt_tokens,
                "prefill_tokens_saved_by_the_tree": tree_hit_tokens,
            }
        )
    images = sum(min(t + 1, window) for _, t in schedule)
    return {
        "agents": agents,
        "turns": turns,
        "window_screenshots": window,
        "image_tokens": image_tokens,
        "embedding_mib": round(emb_bytes / 2**20, 2),
        "images_in_prompts": images,
        "distinct_images": agents * turns,
        "by_cache_size": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes and workload (the tests' mode)")
    parser.add_argument("--no-encoder", action="store_true", help="skip timing the CLIP encoder (needs torch)")
    args = parser.parse_args()
    sizes = [0, 5, 20] if args.tiny else [0, 16, 64, 100, 256]
    hashes = hash_figures(args.tiny, not args.no_encoder)
    loops = {
        "sliding_window": agent_loop(args.tiny, sizes, 2 if args.tiny else 3),
        "full_history": agent_loop(args.tiny, sizes, None),
    }
    encoder_ms_per_image = hashes["llava_1_5"].get("encoder_ms")
    if encoder_ms_per_image is not None:
        _add_encoder_seconds(loops, encoder_ms_per_image)
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
        "note": "CPU figures on a shared machine",
        "hash": hashes,
        "agent_loop": loops,
    }
    print(json.dumps(report, indent=2))


def _add_encoder_seconds(loops: dict[str, Any], encoder_ms_per_image: float) -> None:
    """Each row's encoder time at the measured ms per image (``hash.llava_1_5.encoder_ms``): the
    runs left, and the time saved against encoding every image of every prompt (no tree reuse, no
    embedding cache)."""
    for loop in loops.values():
        every = loop["images_in_prompts"]
        for row in loop["by_cache_size"]:
            row["encoder_seconds"] = round(row["encoder_runs"] * encoder_ms_per_image / 1000, 2)
            row["encoder_seconds_saved"] = round((every - row["encoder_runs"]) * encoder_ms_per_image / 1000, 2)


if __name__ == "__main__":
    main()
