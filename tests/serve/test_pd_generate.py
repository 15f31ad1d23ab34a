"""``decode_generate`` (what ``generate --disaggregation-mode decode`` runs) against a prefill
server built as ``generate --disaggregation-mode prefill`` builds it, serving in a thread: the
tokens of a colocated ``generate``, the decode server's counters, and a request whose KV cannot be
moved in time ends failed with its reason (the server leak free)."""

from __future__ import annotations

import secrets
import threading

import pytest

from kvjax.disaggregation.serving import decode_generate, prefill_config, prefill_server
from kvjax.serve.generate import generate, resolve_model

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [9, 9, 9]]


@pytest.mark.timeout(240)
def test_decode_generate_gives_generate_tokens_and_fails_a_stalled_pull():
    secret = secrets.token_hex(32)
    model = resolve_model("tiny")
    prefill = prefill_server(model, prefill_config(model, page_size=4, max_total_tokens=512), port=0, secret=secret)
    stop = threading.Event()
    thread = threading.Thread(target=prefill.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    try:
        colocated, _ = generate(model, PROMPTS, max_new_tokens=4, page_size=8, stop_token_ids=())
        result, server = decode_generate(
            model,
            PROMPTS,
            prefill=[prefill.address],
            max_new_tokens=4,
            page_size=8,
            stop_token_ids=(),
            secret=secret,
            decode_radix_cache=True,
        )
        assert result.outputs == colocated.outputs
        assert result.cached_tokens == colocated.cached_tokens == 8  # the second prompt's first page of 8
        assert result.prompt_tokens == colocated.prompt_tokens == 25
        pd = result.disaggregation
        assert pd is not None and pd["failed"] == [] and pd["failed_requests"] == 0, pd
        assert (pd["pulled_tokens"], pd["reused_tokens"], pd["pulls"]) == (17, 8, 3), pd
        assert server.leak_free()

        prefill.stall_pull_s = 2.0
        stalled, server = decode_generate(
            model,
            [[5, 6, 7, 8, 9]],
            prefill=[prefill.address],
            max_new_tokens=4,
            page_size=8,
            timeout_s=0.5,
            secret=secret,
        )
        pd = stalled.disaggregation
        assert pd is not None and pd["failed_requests"] == 1 and [f["prompt"] for f in pd["failed"]] == [1], pd
        assert "0.5 s" in pd["failed"][0]["reason"], pd
        assert server.leak_free()
    finally:
        stop.set()
        thread.join(10)
        prefill.close()


@pytest.mark.timeout(240)
def test_a_prompt_whose_prefill_server_is_lost_is_retried_on_the_next_one():
    secret = secrets.token_hex(32)
    model = resolve_model("tiny")
    config = prefill_config(model, page_size=4, max_total_tokens=512)
    lost, kept = (prefill_server(model, config, port=0, secret=secret) for _ in range(2))
    # the first server closes the link of the first prompt it is sent (a server that went away)
    lost._order = lambda link, order: lost._drop_link(link, "test: the server went away")  # type: ignore[method-assign]
    stop = threading.Event()
    threads = [threading.Thread(target=s.serve, args=(stop.is_set,), daemon=True) for s in (lost, kept)]
    for thread in threads:
        thread.start()
    try:
        colocated, _ = generate(model, PROMPTS, max_new_tokens=4, page_size=8, stop_token_ids=())
        result, server = decode_generate(
            model,
            PROMPTS,
            prefill=[lost.address, kept.address],
            max_new_tokens=4,
            page_size=8,
            stop_token_ids=(),
            secret=secret,
        )
        assert result.outputs == colocated.outputs
        pd = result.disaggregation
        assert pd is not None and pd["failed"] == [] and pd["prefill_servers"] == 2, pd
        # the first prompt went to the lost server and was sent again; the others skip it
        assert pd["retried_requests"] == 1 and kept.prefilled == 3 and lost.prefilled == 0, pd
        assert not server.peers[0].alive and server.peers[1].alive
        assert server.leak_free() and kept.scheduler.leak_free() and not kept.snapshots
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        lost.close()
        kept.close()
