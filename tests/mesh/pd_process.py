"""One side of a disaggregated pair, as a program of its own (the two-process tests start two).

    python -m tests.mesh.pd_process prefill --checkpoint DIR --tp 4 --page-size 4 [--stall-pull S]
        [--die-on-pull order|offer] [--warmup N]
        prints ``{"address": HOST:PORT}`` and serves until its standard input closes; then prints
        ``{"prefilled": N, "leak_free": bool, "snapshots": N, "offered_tokens": N,
        "dropped_with_link": N}`` (snapshots still held when their decode server's link closed:
        0 when every one was released or expired first). Fault hooks: ``--stall-pull S`` sleeps
        S seconds before answering each pull; ``--die-on-pull order`` exits the process at once
        (``os._exit(3)``) when the first pull order arrives, ``offer`` right after offering the
        second (the first is served: the decode side's transfer connection is open);
        ``--warmup N`` prefills one N-token prompt before listening (compiled before any deadline).
    python -m tests.mesh.pd_process decode --checkpoint DIR --tp 2 --page-size 8 --prefill ADDR
        --requests FILE
        serves the rounds of ``FILE`` (JSON: a list of rounds, each a list of ``{"rid", "prompt",
        "max_new", "extra_key"?}``; a round starts when the one before it ended) and prints one
        JSON line: outputs, logits (float32, one row per decode-side token), failed requests with
        their reasons, per-request pulled / reused tokens, seconds from the prefill order to the
        request's end (``elapsed``) and from its first token (or order, when none came) to its end
        (``waited``), the counters and ``leak_free``. Refused at the handshake, it prints
        ``{"refused": "ErrorType: message"}`` instead (before any request).
    python -m tests.mesh.pd_process colocated --checkpoint DIR --tp 2 --requests FILE
        serves the same rounds on one ordinary server (no disaggregation; the reference) and prints
        its outputs, logits (one row per token) and ``leak_free``; ``serve_colocated`` runs it in
        the caller's process.

Both build a scheduler recording logits over a cache of the checkpoint (``--max-total-tokens``,
``--overlap``, ``--kv-cache-dtype``), over a ``"tp"`` mesh of their first ``--tp`` devices. The cluster secret comes
from ``KVJAX_CLUSTER_SECRET``; ``--fingerprint`` replaces the model's (a mismatch test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from kvjax import CacheConfig, build_kv_cache
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.scheduler import Scheduler, ServingReq


def scheduler(args: argparse.Namespace) -> tuple[Scheduler, str]:
    model = load_checkpoint(args.checkpoint)
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[: args.tp]) if args.tp > 1 else None
    config = CacheConfig(
        context_length=256,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=32,
        tp_size=args.tp,
        kv_cache_dtype=args.kv_cache_dtype,
        disaggregation_mode="null" if args.role == "colocated" else args.role,
        disaggregation_decode_enable_radix_cache=args.role == "decode" and not args.no_decode_radix,
        # SGLang's decode server without its radix cache runs with the radix cache disabled
        disable_radix_cache=args.role == "decode" and args.no_decode_radix,
        disaggregation_decode_retraction_backup=args.retraction_backup if args.role == "decode" else None,
    )
    cache = build_kv_cache(model.spec, config, mesh=mesh)
    sched = Scheduler(
        model.config,
        cache,
        model.params,
        max_batch_size=4,
        chunked_prefill_size=32,
        record_logits=True,
        overlap=not args.no_overlap,
    )
    return sched, args.fingerprint or model.fingerprint


def serve_prefill(args: argparse.Namespace) -> dict[str, Any]:
    from kvjax.disaggregation.prefill import PrefillServer

    sched, fingerprint = scheduler(args)
    if args.warmup:
        sched.submit([ServingReq("warmup", np.arange(args.warmup, dtype=np.int32) % 7, max_new_tokens=1)])
        while not sched.idle:
            sched.step()
    server = PrefillServer(sched, fingerprint=fingerprint)
    server.stall_pull_s = args.stall_pull
    dropped_with_link = 0
    drop_link, pull = server._drop_link, server._pull

    def counted_drop(link: int, why: str) -> None:
        nonlocal dropped_with_link
        dropped_with_link += sum(key[0] == link for key in server.snapshots)
        drop_link(link, why)

    pulls = 0

    def dying_pull(link: int, order: Any) -> None:
        nonlocal pulls
        pulls += 1
        if args.die_on_pull == "offer":
            pull(link, order)
            if pulls == 1:
                return
        os._exit(3)

    server._drop_link = counted_drop  # type: ignore[method-assign]
    if args.die_on_pull:
        server._pull = dying_pull  # type: ignore[method-assign]
    print(json.dumps({"address": server.address}), flush=True)
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    server.serve(closed.is_set)
    # let what is queued finish and read what the decode servers sent (a Release sent while this
    # server stalled), until each link closed or the bound
    deadline = time.monotonic() + 30
    while not sched.idle or (any(link.ready() for link in server.links.values()) and time.monotonic() < deadline):
        server.serve_once()
    report = {
        "prefilled": server.prefilled,
        "leak_free": sched.leak_free(),
        "snapshots": len(server.snapshots),
        "offered_tokens": server.offered_tokens,
        "dropped_with_link": dropped_with_link,
    }
    server.close()
    return report


def serve_decode(args: argparse.Namespace) -> dict[str, Any]:
    from kvjax.disaggregation.decode import DecodeServer

    sched, fingerprint = scheduler(args)
    with open(args.requests) as f:
        rounds = json.load(f)
    from kvjax.disaggregation.decode import PDRefused
    from kvjax.disaggregation.link import LinkError

    try:
        server = DecodeServer(sched, fingerprint=fingerprint, prefill=args.prefill.split(","), timeout_s=args.timeout)
    except (PDRefused, LinkError) as e:
        return {"refused": f"{type(e).__name__}: {e}"}
    outputs, logits, failed, pulled, reused, elapsed, waited = {}, {}, {}, {}, {}, {}, {}
    for round_ in rounds:
        reqs = [
            ServingReq(r["rid"], r["prompt"], max_new_tokens=r["max_new"], extra_key=r.get("extra_key")) for r in round_
        ]
        rooms = {}
        server.submit(reqs)
        rooms.update({rid: room for rid, room in server.rooms.items()})
        ended = {}
        while not server.idle:
            for req in server.step():
                ended[req.rid] = time.perf_counter()
        for req in reqs:
            if req.abort_reason is not None:
                failed[req.rid] = req.abort_reason
            outputs[req.rid] = list(req.output_ids)
            logits[req.rid] = np.asarray(req.logits, np.float32).tolist()
            room = rooms[req.rid]
            pulled[req.rid] = room.pulled_tokens
            reused[req.rid] = room.reused_tokens
            elapsed[req.rid] = ended[req.rid] - room.ordered_at
            waited[req.rid] = ended[req.rid] - (room.prefilled_at or room.ordered_at)
    report = {
        "outputs": outputs,
        "logits": logits,
        "failed": failed,
        "pulled": pulled,
        "reused": reused,
        "elapsed": elapsed,
        "waited": waited,
        "pulled_tokens": server.pulled_tokens,
        "reused_tokens": server.reused_tokens,
        "retried": server.retried,
        "leak_free": server.leak_free(),
        "signature": list(server.signature),
    }
    server.close()
    return report


def serve_colocated(args: argparse.Namespace) -> dict[str, Any]:
    sched, _ = scheduler(args)
    with open(args.requests) as f:
        rounds = json.load(f)
    outputs, logits = {}, {}
    for round_ in rounds:
        reqs = [
            ServingReq(r["rid"], r["prompt"], max_new_tokens=r["max_new"], extra_key=r.get("extra_key")) for r in round_
        ]
        sched.submit(reqs)
        while not sched.idle:
            sched.step()
        for req in reqs:
            outputs[req.rid] = list(req.output_ids)
            logits[req.rid] = np.asarray(req.logits, np.float32).tolist()
    return {"outputs": outputs, "logits": logits, "leak_free": sched.leak_free()}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("prefill", "decode", "colocated"))
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--no-decode-radix", action="store_true", help="decode: SGLang's default tree (no radix cache)")
    p.add_argument("--retraction-backup", default=None, help="decode: cpu_tensor or host_pool (default: SGLang's)")
    p.add_argument("--fingerprint", default="")
    p.add_argument("--stall-pull", type=float, default=0.0)
    p.add_argument("--die-on-pull", choices=("order", "offer"), default=None)
    p.add_argument("--warmup", type=int, default=0, help="prefill: tokens of a prompt prefilled before listening")
    p.add_argument("--prefill", default="")
    p.add_argument("--requests", default="")
    p.add_argument("--timeout", type=float, default=30.0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    serve = {"prefill": serve_prefill, "decode": serve_decode, "colocated": serve_colocated}[args.role]
    report = serve(args)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
