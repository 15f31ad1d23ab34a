"""A LLaVA model served with images matches Transformers' ``LlavaForConditionalGeneration``.

The tiny random-weight checkpoint of ``llava_checkpoint`` (CLIP tower, projector, 2-layer Llama;
16 placeholder tokens per image) is loaded by kvjax (the language model by ``load_checkpoint``,
the vision side by ``load_image_encoder``) and served through the scheduler with the
``MultimodalExtension``, chunked prefill of 8 tokens (every image is split across chunks), at
page sizes 1 and 16. Each request's greedy tokens and logits equal Transformers' ``generate`` on
the same prompt and pixel values (``LOGIT_ATOL``, with the near-tie guard). Rounds on one cache:

1. ``a``: text, image 0, text; ``c``: the same text around image 1 (no false hit: the tree
   matches nothing of ``c`` past the last whole page before its image; image 1 is encoded);
   ``two``: images 1 and 0 in one prompt (both from the embedding cache: no encoder run).
2. ``a2``: ``a``'s prompt, its output and new text: its KV comes from the tree past the image
   (cached tokens cover it) and the encoder does not run.

Each distinct image is encoded once in all (an image split by chunked prefill included).
The same rounds through a pool of 72 tokens (page size 1, 3 running requests) evict prefixes and
retract a request, and through an embedding cache of one image's bytes evict embeddings; every
output still equals Transformers'. With the radix cache off (cold) the tokens are the warm run's.
The embedding cache's bytes stay within its bound after every step.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.multimodal import EmbeddingCache, hash_item
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint
from kvjax.serve.image_encoder import ImageEncoder, load_image_encoder
from kvjax.serve.kinds import default_extensions
from kvjax.serve.multimodal_extension import MultimodalExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.llava_checkpoint import IMAGE_TOKEN, TOKENS_PER_IMAGE, images, tiny_llava
from tests.serve.parity_harness import MARGIN_FACTOR, assert_no_near_tie, torch

LOGIT_ATOL = 1e-4
CHUNK = 8
MAX_NEW = 4
IMG = [IMAGE_TOKEN] * TOKENS_PER_IMAGE


def _text(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, IMAGE_TOKEN, n)]


_RNG = np.random.default_rng(11)
SYSTEM, QUESTION, BETWEEN, FOLLOW_UP = _text(_RNG, 5), _text(_RNG, 12), _text(_RNG, 3), _text(_RNG, 6)
PIXELS = images(2, seed=5)

# name -> (prompt with placeholders, image indices)
ROUND_1: dict[str, tuple[list[int], list[int]]] = {
    "a": (SYSTEM + IMG + QUESTION, [0]),
    "c": (SYSTEM + IMG + QUESTION, [1]),
    "two": (SYSTEM + IMG + BETWEEN + IMG + QUESTION, [1, 0]),
}


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> tuple[Any, LoadedModel, ImageEncoder]:
    hf, directory = tiny_llava(tmp_path_factory, "llava_parity", seed=1)
    return hf, load_checkpoint(directory), load_image_encoder(directory)


_GREEDY: weakref.WeakKeyDictionary[Any, dict[Any, tuple[list[int], np.ndarray]]] = weakref.WeakKeyDictionary()


def hf_greedy(hf: Any, prompt: list[int], image_ids: list[int]) -> tuple[list[int], np.ndarray]:
    """Transformers' greedy tokens and logits ``[MAX_NEW, vocab]`` for ``prompt`` with the images."""
    memo = _GREEDY.setdefault(hf, {})
    key = (tuple(prompt), tuple(image_ids))
    if key not in memo:
        with torch.no_grad():
            out = hf.generate(
                input_ids=torch.tensor([prompt]),
                pixel_values=torch.tensor(PIXELS[image_ids]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
            )
        memo[key] = (out.sequences[0, len(prompt) :].tolist(), np.stack([s[0].numpy() for s in out.logits]))
    tokens, logits = memo[key]
    return list(tokens), logits.copy()


def serve_rounds(
    model: LoadedModel,
    encoder: ImageEncoder,
    *,
    max_batch_size: int = 4,
    image_cache_bytes: int | None = None,
    mesh: Any = None,
    **cache_config: Any,
) -> tuple[Scheduler, MultimodalExtension, dict[str, tuple[ServingReq, list[int], list[int]]]]:
    """The rounds of the module docstring on a new cache (``image_cache_bytes``: the embedding
    cache's size, default the plan's; ``mesh``: the mesh the cache is built over, with ``tp_size``
    in ``cache_config``); the embedding cache's bytes are checked against its bound after every
    step."""
    cache_config.setdefault("max_total_tokens", 1024)
    config = CacheConfig(context_length=124, chunked_prefill_size=CHUNK, **cache_config)
    cache = build_kv_cache(model.spec, config, mesh=mesh)
    images_cache: EmbeddingCache[Any] = (
        EmbeddingCache.from_plan(cache.plan) if image_cache_bytes is None else EmbeddingCache(image_cache_bytes)
    )
    mm = MultimodalExtension.for_encoder(encoder, images_cache, model.config.vocab_size)
    sched = Scheduler(
        model.config,
        cache,
        model.params,
        max_batch_size=max_batch_size,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        extensions=[*default_extensions(cache), mm],
    )
    step = sched.step

    def checked_step() -> list[ServingReq]:
        finished = step()
        assert images_cache.bytes_used <= images_cache.max_bytes
        return finished

    sched.step = checked_step  # type: ignore[method-assign]
    done: dict[str, tuple[ServingReq, list[int], list[int]]] = {}
    first = {n: mm.request(n, p, PIXELS[ids], max_new_tokens=MAX_NEW) for n, (p, ids) in ROUND_1.items()}
    sched.run(first.values())
    done.update((n, (first[n], *ROUND_1[n])) for n in first)
    a, prompt_a = first["a"], ROUND_1["a"][0]
    prompt_a2 = prompt_a + a.output_ids + FOLLOW_UP
    runs = encoder.runs
    a2 = mm.request("a2", prompt_a2, PIXELS[[0]], max_new_tokens=MAX_NEW)
    sched.run([a2])
    if image_cache_bytes is None:
        assert encoder.runs == runs, "the repeated image was encoded again"
    done["a2"] = (a2, prompt_a2, [0])
    assert sched.leak_free()
    assert mm.registered == 0
    return sched, mm, done


def assert_matches(hf: Any, done: dict[str, tuple[ServingReq, list[int], list[int]]]) -> None:
    for name, (req, prompt, ids) in done.items():
        tokens, logits = hf_greedy(hf, prompt, ids)
        assert_no_near_tie(name, logits, MARGIN_FACTOR * LOGIT_ATOL)
        assert req.output_ids == tokens, f"{name}: kvjax {req.output_ids} != transformers {tokens}"
        np.testing.assert_allclose(np.stack(req.logits), logits, atol=LOGIT_ATOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("page_size", [1, 16])
def test_images_served_as_transformers(llava, page_size):
    hf, model, encoder = llava
    before = encoder.images_encoded
    sched, mm, done = serve_rounds(model, encoder, page_size=page_size)
    assert_matches(hf, done)
    # Each distinct image encoded once, though every image was split across prefill chunks.
    assert encoder.images_encoded - before == 2
    image_start = len(SYSTEM)
    a2 = done["a2"][0]
    assert a2.first_cached_tokens is not None and a2.first_cached_tokens >= image_start + TOKENS_PER_IMAGE
    c = done["c"][0]  # image 1 behind the same text: the match stops before the image
    assert c.first_cached_tokens is not None and c.first_cached_tokens <= image_start
    assert done["a"][0].output_ids != c.output_ids or not np.allclose(done["a"][0].logits, c.logits)
    stats = mm.stats()
    assert stats["bytes_used"] <= stats["max_bytes"] and stats["images_encoded"] >= 2
    served = sched.stats
    assert (served.images_encoded, served.image_cache_misses) == (2, 2) and served.image_cache_hits >= 1
    assert sched.stats.cached_tokens > 0


def test_cold_equals_warm(llava):
    """The rounds with the radix cache off (a chunk cache: nothing shared, every image encoded
    for each request that holds it) give the warm run's tokens, leak free."""
    _, model, encoder = llava
    _, _, warm = serve_rounds(model, encoder, page_size=16)
    before = encoder.images_encoded
    cold_sched, _, cold = serve_rounds(model, encoder, page_size=16, disable_radix_cache=True)
    assert cold_sched.stats.cached_tokens == 0
    assert {n: r.output_ids for n, (r, _, _) in cold.items()} == {n: r.output_ids for n, (r, _, _) in warm.items()}
    # The embedding cache still spares the encoder what it holds: each distinct image once.
    assert encoder.images_encoded - before == 2


def test_eviction_and_retraction(llava):
    hf, model, encoder = llava
    sched, _, done = serve_rounds(model, encoder, page_size=1, max_total_tokens=72, max_running_requests=3)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert_matches(hf, done)


def test_an_embedding_cache_of_one_image(llava):
    """The embedding cache holds one image's embedding (16 x 64 float32 = 4096 bytes): the two
    images evict each other and are encoded again when their KV is not in the tree; outputs stay
    Transformers'."""
    hf, model, encoder = llava
    size = TOKENS_PER_IMAGE * model.config.hidden_size * 4
    sched, mm, done = serve_rounds(model, encoder, page_size=16, image_cache_bytes=size)
    assert mm.cache.evictions > 0 and sched.stats.image_cache_evictions > 0
    assert sched.stats.images_encoded > 2
    assert_matches(hf, done)


def test_bad_input_registers_nothing(llava):
    _, model, encoder = llava
    mm = MultimodalExtension.for_encoder(encoder, EmbeddingCache(1 << 20), model.config.vocab_size)
    with pytest.raises(ValueError, match="placeholder tokens.*2 items need 32"):
        mm.request("x", SYSTEM + IMG + QUESTION, PIXELS, max_new_tokens=1)
    with pytest.raises(ValueError, match=r"image 0 of shape \(3, 8, 8\)"):
        mm.request("y", SYSTEM + IMG, np.zeros((1, 3, 8, 8), np.float32), max_new_tokens=1)
    assert mm.registered == 0 and encoder.runs >= 0
    req = mm.request("z", SYSTEM + IMG, PIXELS[:1], max_new_tokens=1)
    assert req.origin_input_ids[len(SYSTEM)] == mm.items(req)[0].pad_value
    assert mm.items(req)[0].hash == hash_item(PIXELS[0])
