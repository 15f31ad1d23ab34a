"""LLaVA with images over two processes (tp 2: one CPU device each) through the multi-process
front: the rounds of ``tests/serve/test_parity_llava`` (an image repeated, two images behind the
same text, images split by chunked prefill; ``a2`` reuses ``a``'s image through the tree), the
images travelling from process 0 to process 1 in the step messages. Both processes finish every
request with the one-process run's tokens, make the same embedding-cache decisions (each distinct
image encoded once on each), compare state digests at every step, and end leak free with no
image held.

Run as a program (``python -m tests.mesh.test_multihost_llava DIR``) it is one process of the
group.
"""

from __future__ import annotations

import json
import sys

from tests.mesh.multihost_group import assert_all_ok, join_and_load, run_group

TP = 2


def test_llava_over_two_processes_equals_one(tmp_path_factory):
    from kvjax.serve.checkpoint import load_checkpoint
    from kvjax.serve.image_encoder import load_image_encoder
    from tests.serve.llava_checkpoint import tiny_llava
    from tests.serve.test_parity_llava import serve_rounds

    _, directory = tiny_llava(tmp_path_factory, "llava_multihost", seed=1)
    _, _, done = serve_rounds(load_checkpoint(directory), load_image_encoder(directory), page_size=16)
    one = {name: list(req.output_ids) for name, (req, _, _) in done.items()}
    args = ["-m", "tests.mesh.test_multihost_llava", str(directory)]
    reports = assert_all_ok(run_group(args, devices=TP // 2, timeout=300))
    for r in reports:
        assert r["outputs"] == one, (r["outputs"], one)
        assert r["leak_free"] and r["digest_checks"] > 0 and r["registered"] == 0, r
        assert r["images_encoded"] == 2 and r["cached_tokens"] > 0, r
    assert reports[0]["image_cache"] == reports[1]["image_cache"]
    assert reports[1]["ignored_submissions"] == 4


def _serve(directory: str) -> dict:
    group, model = join_and_load(directory)
    from kvjax import CacheConfig, build_kv_cache
    from kvjax.multimodal import EmbeddingCache
    from kvjax.serve.image_encoder import load_image_encoder
    from kvjax.serve.kinds import default_extensions
    from kvjax.serve.multihost.front import MultiProcessFront
    from kvjax.serve.multihost.mesh import group_tp_mesh
    from kvjax.serve.multimodal_extension import MultimodalExtension
    from kvjax.serve.scheduler import Scheduler
    from tests.serve.test_parity_llava import CHUNK, FOLLOW_UP, MAX_NEW, PIXELS, ROUND_1

    encoder = load_image_encoder(directory)
    config = CacheConfig(
        context_length=124, chunked_prefill_size=CHUNK, page_size=16, max_total_tokens=1024, tp_size=TP
    )
    cache = build_kv_cache(model.spec, config, mesh=group_tp_mesh(TP))
    mm = MultimodalExtension.for_encoder(encoder, EmbeddingCache.from_plan(cache.plan), model.config.vocab_size)
    sched = Scheduler(
        model.config,
        cache,
        model.params,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        agreement=group.agreement(),
        extensions=[*default_extensions(cache), mm],
    )
    front = MultiProcessFront(sched, group.channel, check_agreement=True)
    # One driver everywhere: every process makes the requests; only process 0's are served.
    front.run([mm.request(n, p, PIXELS[ids], max_new_tokens=MAX_NEW) for n, (p, ids) in ROUND_1.items()])
    a = next(r for r in front.finished if r.rid == "a")
    prompt_a2 = ROUND_1["a"][0] + list(a.output_ids) + FOLLOW_UP
    front.run([mm.request("a2", prompt_a2, PIXELS[[0]], max_new_tokens=MAX_NEW)])
    stats = mm.stats()
    return {
        "outputs": {str(r.rid): list(r.output_ids) for r in front.finished},
        "leak_free": front.leak_free(),
        "digest_checks": front.digest_checks,
        "registered": mm.registered,
        "images_encoded": sched.stats.images_encoded,
        "cached_tokens": sched.stats.cached_tokens,
        "image_cache": {k: stats[k] for k in ("hits", "misses", "evictions", "bytes_used")},
        "ignored_submissions": front.ignored_submissions,
    }


if __name__ == "__main__":
    print(json.dumps(_serve(sys.argv[1])))
