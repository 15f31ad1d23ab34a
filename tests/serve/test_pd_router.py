"""`PDRouter` in one process: two decode servers sharing two prefill servers (each serving in a
thread of its own), the tiny model with random weights. Every request is routed, both decode
servers and both prefill servers are used, the greedy tokens equal colocated serving, and every
server ends leak free."""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.disaggregation.decode import DecodeServer
from kvjax.disaggregation.prefill import PrefillServer
from kvjax.disaggregation.router import PDRouter, _least_loaded
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.spec import ModelSpec

SPEC = ModelSpec.preset("tiny")
FINGERPRINT = "tiny-seed-0"
SECRET = secrets.token_hex(32)


def _scheduler(params, page_size: int, mode: str = "null") -> Scheduler:
    config = CacheConfig(
        context_length=128,
        page_size=page_size,
        max_total_tokens=512,
        chunked_prefill_size=64,
        disaggregation_mode=mode,
        disaggregation_decode_retraction_backup="cpu_tensor" if mode == "decode" else None,
    )
    return Scheduler(SPEC, build_kv_cache(SPEC, config), params, max_batch_size=4)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    system = rng.integers(0, SPEC.vocab_size, 16).tolist()
    prompts = [system + rng.integers(0, SPEC.vocab_size, n).tolist() for n in (3, 9, 5)]
    return prompts + [rng.integers(0, SPEC.vocab_size, n).tolist() for n in (7, 21, 12)]


@contextlib.contextmanager
def _prefill_servers(params, count: int) -> Iterator[list[PrefillServer]]:
    """``count`` prefill servers, each serving in a thread until the block ends."""
    servers = [
        PrefillServer(_scheduler(params, 4, "prefill"), fingerprint=FINGERPRINT, secret=SECRET, name=f"prefill-{i}")
        for i in range(count)
    ]
    stop = threading.Event()
    threads = [threading.Thread(target=s.serve, args=(stop.is_set,), daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield servers
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        for server in servers:
            server.close()


def test_least_loaded_breaks_ties_round_robin():
    assert _least_loaded([1, 0, 0], 0) == 1
    assert _least_loaded([0, 0, 0], 2) == 2
    assert _least_loaded([0, 1, 0], 1) == 2
    assert _least_loaded([2, 1, 1], 0) == 1


@pytest.mark.timeout(240)
def test_two_decode_servers_share_two_prefill_servers():
    params = init_params(SPEC, seed=0)
    prompts = _prompts()
    colocated = _scheduler(params, 4)
    expected = {
        r.rid: list(r.output_ids)
        for r in colocated.run([ServingReq(i, p, max_new_tokens=5) for i, p in enumerate(prompts)])
    }

    with _prefill_servers(params, 2) as prefill:
        addresses = [s.address for s in prefill]
        decode = [
            DecodeServer(
                _scheduler(params, 8, "decode"),
                fingerprint=FINGERPRINT,
                prefill=addresses,
                secret=SECRET,
                name=f"decode-{i}",
            )
            for i in range(2)
        ]
        router = PDRouter(decode)
        try:
            done = router.run([ServingReq(i, p, max_new_tokens=5) for i, p in enumerate(prompts)])
        finally:
            router.close()
        assert not router.failed, [r.abort_reason for r in router.failed]
        assert {r.rid: list(r.output_ids) for r in done} == expected
        assert sorted(router.route) == list(range(len(prompts)))  # every request routed, once
        assert router.decode_requests == [3, 3] and router.prefill_requests == [3, 3]
        assert {d for d, _ in router.route.values()} == {0, 1} and {p for _, p in router.route.values()} == {0, 1}
        counters = router.counters()
        assert [c["requests"] for c in counters["decode"]] == [3, 3]
        assert sum(c["pulled_tokens"] + c["reused_tokens"] for c in counters["decode"]) == sum(map(len, prompts))
        assert router.leak_free()
        assert sum(s.prefilled for s in prefill) == len(prompts)


def test_a_router_needs_decode_servers_linked_alike():
    with pytest.raises(ValueError, match="at least one decode server"):
        PDRouter([])
