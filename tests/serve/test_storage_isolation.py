"""The storage tier never serves another model's KV, nor a damaged entry (issue 19).

Two tiny Llama checkpoints with the same config and different weights, each saved in a folder
named ``model``, share one store directory: the second model gets no page of the first, and its
own tokens; the same model twice hits. A truncated entry and a flipped byte are misses, counted,
and the tokens stay those of the radix cache off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvjax import ModelSpec
from kvjax.demo import demo_cache
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint, save_checkpoint
from kvjax.serve.model import init_params
from kvjax.serve.model_fingerprint import random_weights_fingerprint
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.tiers.storage import StorageTier, page_hashes
from kvjax.tiers.storage_entry import HEADER_BYTES

SPEC = ModelSpec.preset("tiny")
PAGE = 4
PROMPT = 32
STORED = (PROMPT - 1) // PAGE * PAGE  # a match never covers a prompt's last token: 7 whole pages


def _requests() -> list[ServingReq]:
    """Two ``PROMPT``-token prompts, served one after the other."""
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 256, PROMPT)] for _ in range(2)]
    return [ServingReq(f"r{i}", p, max_new_tokens=2) for i, p in enumerate(prompts)]


def _serve(model: LoadedModel, store: Path | None, **config) -> Scheduler:
    if store is not None:
        config.update(
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            hicache_storage_dir=str(store),
            hicache_storage_model_fingerprint=model.fingerprint,
            hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_prefetch_threshold=PAGE,
        )
    cache = demo_cache(spec=model.spec, page_size=PAGE, max_total_tokens=96, chunked_prefill_size=64, **config)
    sched = Scheduler(model.config, cache, model.params, max_batch_size=2)
    for req in _requests():
        sched.run([req])
    if store is not None:
        cache.tree_cache.check_transfers(wait=True)  # host copies land, storage writes start
        cache.tree_cache.storage.check_writes(wait=True)
    assert sched.leak_free()
    return sched


def _outputs(sched: Scheduler) -> list[list[int]]:
    return [list(r.output_ids) for r in sorted(sched.finished, key=lambda r: r.rid)]


def _prefetched(sched: Scheduler) -> int:
    return sched.cache.tree_cache.storage.prefetched_tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[LoadedModel, LoadedModel]:
    """Same config, different weights, both in a folder named ``model``."""
    root = tmp_path_factory.mktemp("ckpts")
    a = load_checkpoint(save_checkpoint(root / "a" / "model", SPEC, init_params(SPEC, seed=1)))
    b = load_checkpoint(save_checkpoint(root / "b" / "model", SPEC, init_params(SPEC, seed=2)))
    assert a.name == b.name == "model" and a.spec == b.spec
    return a, b


def test_a_second_checkpoint_in_a_same_named_folder_gets_none_of_the_first_ones_pages(models, tmp_path):
    a, b = models
    assert a.fingerprint != b.fingerprint
    store = tmp_path / "l3"
    cold_a = _outputs(_serve(a, None, disable_radix_cache=True))
    cold_b = _outputs(_serve(b, None, disable_radix_cache=True))
    assert cold_a != cold_b  # the weights differ enough that borrowed KV would show

    first = _serve(a, store)
    assert _outputs(first) == cold_a and _prefetched(first) == 0
    assert first.cache.tree_cache.storage.storage.pages_written > 0

    again = _serve(a, store)  # the same model twice: its pages come back
    assert _outputs(again) == cold_a
    assert _prefetched(again) == 2 * STORED

    other = _serve(b, store)  # another model, same folder name, same config, same store
    link = other.cache.tree_cache.storage
    assert _prefetched(other) == 0 and link.storage.pages_read == 0
    assert link.storage.rejected_entries == 0  # its pages live elsewhere: plain misses
    assert _outputs(other) == cold_b
    digests = sorted(p.name for p in store.iterdir())
    assert len(digests) == 2 and (store / digests[0] / "key.json").is_file()


def test_a_truncated_and_a_flipped_entry_are_misses_and_the_tokens_stay_right(models, tmp_path, caplog):
    a, _ = models
    store = tmp_path / "l3"
    cold = _outputs(_serve(a, None, disable_radix_cache=True))
    first = _serve(a, store)
    key = first.cache.tree_cache.storage.storage.storage_key
    entries = sorted(p for p in (store / key.digest).iterdir() if p.name != "key.json")
    assert len(entries) >= 16
    # Request r0's first page (its run stops there) and r1's third page (its run stops after two).
    torn = store / key.digest / _page_files(first, 0)[0]
    torn.write_bytes(torn.read_bytes()[: HEADER_BYTES + key.page_bytes // 2])
    flipped = store / key.digest / _page_files(first, 1)[2]
    data = bytearray(flipped.read_bytes())
    data[HEADER_BYTES + 7] ^= 0x10
    flipped.write_bytes(bytes(data))

    with caplog.at_level("WARNING", logger="kvjax.tiers.storage"):
        again = _serve(a, store)
    stored = again.cache.tree_cache.storage.storage
    assert _outputs(again) == cold
    assert dict(stored.rejected) == {"torn": 1, "checksum": 1}
    assert _prefetched(again) == 2 * PAGE  # r0: nothing; r1: the two pages before the flipped one
    assert sum("refused entry" in r.message for r in caplog.records) == 1  # warned once
    # The refused entries were deleted and written again by the run's own backups.
    third = _serve(a, store)
    assert _outputs(third) == cold and _prefetched(third) == 2 * STORED
    assert third.cache.tree_cache.storage.storage.rejected_entries == 0


def _page_files(sched: Scheduler, i: int) -> list[str]:
    """The store file names of request ``i``'s prompt pages, in order."""
    tree = sched.cache.tree_cache
    prompt = list(_requests()[i].origin_input_ids)
    return [f"{h & 0xFFFFFFFFFFFFFFFF:016x}" for h in page_hashes(prompt, PAGE, seed=tree.hash_seed)]


def test_caches_that_differ_in_page_size_dtype_namespace_or_model_key_their_pages_apart(tmp_path):
    base = dict(
        page_size=PAGE,
        max_total_tokens=96,
        enable_hierarchical_cache=True,
        hicache_storage_backend="memory",
        hicache_storage_model_fingerprint=random_weights_fingerprint(SPEC, seed=0),
    )
    variants = {
        "base": {},
        "page size": dict(page_size=2 * PAGE),
        "kv dtype": dict(kv_cache_dtype="bfloat16"),
        "fp8": dict(kv_cache_dtype="fp8_e4m3"),
        "namespace": dict(hicache_storage_namespace="tenant-b"),
        "model": dict(hicache_storage_model_fingerprint=random_weights_fingerprint(SPEC, seed=1)),
    }
    keys = {
        name: demo_cache(**{**base, **change}).tree_cache.storage.storage.storage_key
        for name, change in variants.items()
    }
    assert len({k.digest for k in keys.values()}) == len(variants)
    assert keys["base"] == demo_cache(**base).tree_cache.storage.storage.storage_key  # deterministic
    assert keys["base"].kv_dtype == "float32" and keys["kv dtype"].kv_dtype == "bfloat16"
    assert keys["base"].layout == "mha/page_first" and keys["base"].layers == (0, 1)
    assert keys["namespace"].namespace == "tenant-b"
    assert keys["fp8"].kv_dtype == "float8_e4m3fn" and keys["fp8"].kv_scales == (1.0,) * 4
    assert keys["base"].kv_scales == ()
    # One store directory, written under the base key: every other key misses it.
    tokens = list(range(8 * PAGE))
    hashes = page_hashes(tokens, PAGE)
    base_tier = StorageTier(str(tmp_path), key=keys["base"])
    pages = np.ones((len(hashes), *keys["base"].page_shape), base_tier.dtype)
    assert base_tier.backup(hashes, pages).wait() == len(hashes)
    for name, key in keys.items():
        tier = StorageTier(str(tmp_path), key=key)
        want = len(hashes) if name == "base" else 0
        assert tier.leading_hits(page_hashes(tokens, key.page_size)) == want, name
