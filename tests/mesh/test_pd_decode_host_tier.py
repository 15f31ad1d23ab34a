"""Decode-side prefix reuse through the decode server's host tier (issue 36: "the decode server
keeps its own radix tree (and host tier)").

A decode server with its radix cache and a host tier, its device pool small enough that a chat's
earlier turns are evicted to the host by the chats after them: when the chat continues, the host
tier loads its prefix back (the tree's match grows to it) and the decode server pulls only what
neither its device nor its host held. Tokens equal a colocated server's; both sides leak free.
"""

from __future__ import annotations

import secrets
import threading

import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.disaggregation.decode import DecodeServer
from kvjax.disaggregation.prefill import PrefillServer
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler, ServingReq

pytestmark = pytest.mark.mesh

SPEC = ModelSpec.preset("tiny")
MAX_NEW = 4
CHATS = 6


def _scheduler(mode: str, total: int, host: bool = False) -> Scheduler:
    extra = {"disaggregation_decode_enable_radix_cache": True} if mode == "decode" else {}
    config = CacheConfig(
        context_length=256,
        page_size=4,
        max_total_tokens=total,
        chunked_prefill_size=64,
        disaggregation_mode=mode,
        enable_hierarchical_cache=host,
        hicache_ratio=4.0,
        **extra,
    )
    return Scheduler(SPEC, build_kv_cache(SPEC, config), init_params(SPEC, seed=0), max_batch_size=2)


def _turns() -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(7)
    first = [rng.integers(0, SPEC.vocab_size, 40).tolist() for _ in range(CHATS)]
    new = [rng.integers(0, SPEC.vocab_size, 6).tolist() for _ in range(CHATS)]
    return first, new


def test_a_decode_servers_host_tier_gives_back_an_evicted_turn_so_only_the_new_tokens_are_pulled():
    secret = secrets.token_hex(32)
    prefill = PrefillServer(_scheduler("prefill", 2048), fingerprint="tiny", secret=secret)
    stop = threading.Event()
    thread = threading.Thread(target=prefill.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    colocated = _scheduler("null", 2048)
    try:
        decode = DecodeServer(
            _scheduler("decode", 128, host=True), fingerprint="tiny", prefill=[prefill.address], secret=secret
        )
        [host] = [e for e in decode.scheduler.extensions if isinstance(e, HostTierExtension)]
        first, new = _turns()
        turn1 = decode.run([ServingReq(f"c{i}", p, max_new_tokens=MAX_NEW) for i, p in enumerate(first)])
        outputs = {r.rid: list(r.output_ids) for r in turn1}
        assert all(r.abort_reason is None for r in turn1)
        pulled_before = decode.pulled_tokens
        second = [first[i] + outputs[f"c{i}"] + new[i] for i in range(CHATS)]
        turn2 = decode.run([ServingReq(f"c{i}+", p, max_new_tokens=MAX_NEW) for i, p in enumerate(second)])
        assert all(r.abort_reason is None for r in turn2)
        assert host.loaded_tokens > 0, "an evicted turn should have come back from the decode server's host tier"
        pulled = decode.pulled_tokens - pulled_before
        assert pulled < sum(len(p) for p in second) // 2, f"pulled {pulled} of {sum(len(p) for p in second)}"
        want = colocated.run(
            [ServingReq(f"c{i}", p, max_new_tokens=MAX_NEW) for i, p in enumerate(first)]
            + [ServingReq(f"c{i}+", p, max_new_tokens=MAX_NEW) for i, p in enumerate(second)]
        )
        assert {r.rid: list(r.output_ids) for r in [*turn1, *turn2]} == {r.rid: list(r.output_ids) for r in want}
        assert decode.leak_free() and host.host_balanced()
        decode.close()
    finally:
        stop.set()
        thread.join(10)
    assert prefill.scheduler.leak_free() and not prefill.snapshots
    prefill.close()
