"""Block hashes a router recomputes from token ids alone: vLLM's ``sha256_cbor`` chain, computed
here independently with ``cbor2`` as vLLM does, equals what the server's tree puts in its events;
the cache salt enters the first block only; kvjax's own hash stays the storage tier's key."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvjax.kv_events.block_hash import Sha256CborHasher, canonical_cbor
from kvjax.radix import RadixCache
from kvjax.tiers.storage import page_hashes

cbor2 = pytest.importorskip("cbor2")


def vllm_block_hashes(tokens: list[int], block_size: int, seed: str, cache_salt: str | None = None) -> list[int]:
    """vLLM's recipe: NONE_HASH = sha256_cbor(PYTHONHASHSEED); block j hashes (parent, tuple(tokens),
    extra_keys) with the cache salt in block 0's extra keys; events carry the low 64 bits."""

    def sha256_cbor(x):
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    parent = sha256_cbor(seed)
    out = []
    for j in range(len(tokens) // block_size):
        extra = (cache_salt,) if (j == 0 and cache_salt) else None
        parent = sha256_cbor((parent, tuple(tokens[j * block_size : (j + 1) * block_size]), extra))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def test_canonical_cbor_is_cbor2s():
    r = random.Random(0)
    for _ in range(500):
        x = (
            r.randbytes(32),
            tuple(
                r.choice([0, 23, 24, 255, 256, 65535, 65536, 2**32, r.randrange(1 << 20)])
                for _ in range(r.randrange(40))
            ),
            r.choice([None, ("tenant",), ("é-salt",), (5,), ()]),
        )
        assert canonical_cbor(x) == cbor2.dumps(x, canonical=True)
    for v in (-1, -24, -25, -(2**63), 2**64 - 1, True, False, None, "", b""):
        assert canonical_cbor(v) == cbor2.dumps(v, canonical=True)
    with pytest.raises(TypeError, match="float"):
        canonical_cbor(1.5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_router_recomputes_the_event_hashes_from_token_ids(page_size, salt):
    hasher = Sha256CborHasher("0")
    tree = RadixCache(page_size=page_size)
    events: list = []
    tree.start_events(events.append, hasher)
    rng = random.Random(page_size)
    system = [rng.randrange(50_000) for _ in range(64)]
    prompts = [system + [rng.randrange(50_000) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    for p in prompts:
        tree.insert(p, extra_key=salt)
    stored = {}
    for e in events:
        for h in e.block_hashes:
            stored[hasher.wire_hash(h)] = e
    for p in prompts:
        expected = vllm_block_hashes(p, page_size, "0", salt)
        assert hasher.hash_tokens(p, page_size, salt) == expected
        assert all(h in stored for h in expected), "every page of a cached prompt is in the events"
    other = vllm_block_hashes(prompts[0], page_size, "0", "tenant-b")
    assert not set(other) & set(stored), "another tenant's salt hashes every block apart"
    assert vllm_block_hashes(prompts[0], page_size, "1", salt)[0] not in stored, "another seed: other hashes"


def test_salt_enters_the_first_block_only_and_the_chain_carries_it():
    h = Sha256CborHasher("0")
    toks = list(range(48))
    a, b = h.page_hashes(None, toks, 16, "s"), h.page_hashes(None, toks, 16, None)
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert h.page_hashes(a[0], toks[16:], 16, "s") == a[1:] == h.page_hashes(a[0], toks[16:], 16, None)


def test_the_default_hash_is_the_storage_tiers_key():
    tree = RadixCache(page_size=4)
    events: list = []
    tree.start_events(events.append)
    toks = list(range(100, 132))
    tree.insert(toks, extra_key="t")
    assert events[0].block_hashes == page_hashes(toks, 4, extra_key="t", seed=tree.hash_seed)


def test_start_events_refuses_a_tree_that_caches_already():
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3])
    with pytest.raises(ValueError, match="already caches"):
        tree.start_events([])
