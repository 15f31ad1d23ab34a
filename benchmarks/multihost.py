"""Multi-process serving: what keeping the processes in agreement costs per step, against the
decode step itself. Prints one JSON object.

    python benchmarks/multihost.py [--batch 64] [--output-tokens 24] [--transport socket|kv]

Two local processes (``jax.distributed`` on loopback, gloo collectives, one CPU device each)
serve the tiny model at tp 2 (one mesh over both processes) through ``MultiProcessFront``, with a
decode batch of ``--batch`` requests, the exchanges over ``--transport`` (``ProcessFlags``).
Measured on process 0, after a warm-up round that compiles:

* ``decode_step_ms``: host wall time of one decode step (pack + dispatch + wait + bookkeeping);
* ``exchange_ms``: the per-step exchange that broadcasts process 0's requests (digest off), its
  wall time (``follower_exchange_ms``: the same on process 1), in the first measured round. It
  includes waiting for the other process, and overlap scheduling runs it while the previous step
  is on the device, so on a loaded host it is mostly waiting that costs nothing: ``exposed_ms``
  says what it adds;
* ``agree_min_ms``: one MIN all-reduce of 16 values (what the host tier's poll adds per step
  when transfers are pending);
* ``agreement_ms`` = exchange + MIN all-reduce, and ``agreement_over_decode``, its fraction of
  the decode step (wall times, waiting included);
* ``exposed_ms``: what the exchange adds to a step of the serving loop, which overlap scheduling
  runs while the previous step is on the device: the loop's wall time per step through the front
  (``loop_step_ms``) less that of the same rounds with every process stepping its scheduler
  directly (``direct_step_ms``: requests given to every process, no exchange; both the minimum of
  ``ROUNDS`` alternating rounds, each listed in ``*_rounds``), and ``exposed_over_decode``;
* ``cost_over_decode``: the agreement's cost per step, exposed exchange (0 when negative: noise)
  plus one MIN all-reduce, over the decode step (target <= ``target_over_decode``);
* ``digest_ms``: one state digest (paid only with ``KVJAX_CHECK_AGREEMENT=1``).

A CPU figure on this machine: both processes share its cores, the exchanges travel over
loopback, and the step is a tiny model's; on a TPU pod the step is the
chips' and the exchange crosses the data-center network.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TP = 2
PROMPT_TOKENS = 16
AGREE_VALUES = 16
AGREE_CALLS = 100
ROUNDS = 4  # alternating rounds through the front and direct, for exposed_ms


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    from kvjax.multihost.process_group import ProcessFlags, initialize

    group = initialize(
        ProcessFlags(
            args.coordinator,
            2,
            args.process_id,
            cpu_devices=1,
            timeout_s=120,
            join_timeout_s=120,
            transport=args.transport,
        )
    )
    import numpy as np

    from benchmarks._common import machine
    from kvjax import CacheConfig, build_kv_cache
    from kvjax.multihost.digest import serving_digest
    from kvjax.serve.model import init_params
    from kvjax.serve.multihost.front import MultiProcessFront
    from kvjax.serve.multihost.mesh import group_tp_mesh
    from kvjax.serve.scheduler import Scheduler
    from kvjax.serve.serving_req import ServingReq
    from kvjax.spec import ModelSpec

    spec = ModelSpec.preset("tiny")
    batch, out_tokens = args.batch, args.output_tokens
    config = CacheConfig(
        context_length=256,
        page_size=16,
        tp_size=TP,
        max_total_tokens=batch * 64,
        max_running_requests=batch,
        chunked_prefill_size=batch * PROMPT_TOKENS,
    )
    cache = build_kv_cache(spec, config, mesh=group_tp_mesh(TP))
    agreement = group.agreement()
    sched = Scheduler(spec, cache, init_params(spec, seed=0), max_batch_size=batch, agreement=agreement)
    front = MultiProcessFront(sched, group.channel)
    rng = np.random.default_rng(0)

    def requests(tag: str, new_tokens: int) -> list[ServingReq]:
        # the same on every process: the same seed, drawn in the same order
        return [
            ServingReq(f"{tag}{i}", [int(t) for t in rng.integers(0, 256, PROMPT_TOKENS)], max_new_tokens=new_tokens)
            for i in range(batch)
        ]

    def direct_round(tag: str) -> float:
        """Wall seconds per step, every process stepping its own scheduler (no exchange)."""
        sched.submit(requests(tag, out_tokens))
        steps, start = 0, time.perf_counter()
        while not sched.idle:
            sched.step()
            steps += 1
        return (time.perf_counter() - start) / steps

    def front_round(tag: str) -> float:
        """Wall seconds per step through the front."""
        reqs, steps, start = requests(tag, out_tokens), front.steps, time.perf_counter()
        front.run(reqs)
        return (time.perf_counter() - start) / (front.steps - steps)

    front.run(requests("warm", 4))  # compiles the prefill and decode shapes
    st = sched.stats
    before = (st.decode_steps, st.decode_step_seconds + st.decode_pack_seconds + st.decode_bookkeeping_seconds)
    ex_before, steps_before = front.exchange_seconds, front.steps
    loop_s = [front_round("run")]
    decode_steps = st.decode_steps - before[0]
    decode_s = st.decode_step_seconds + st.decode_pack_seconds + st.decode_bookkeeping_seconds - before[1]
    exchange_s = (front.exchange_seconds - ex_before) / (front.steps - steps_before)
    start = time.perf_counter()
    for _ in range(AGREE_CALLS):
        agreement.agree_min("bench", [2] * AGREE_VALUES)
    agree_s = (time.perf_counter() - start) / AGREE_CALLS
    start = time.perf_counter()
    for _ in range(10):
        serving_digest(sched)  # of the tree after one measured round (it grows with every round)
    digest_s = (time.perf_counter() - start) / 10
    direct_s = [direct_round("direct0")]
    for r in range(1, ROUNDS):
        loop_s.append(front_round(f"run{r}"))
        direct_s.append(direct_round(f"direct{r}"))
    exposed_s = min(loop_s) - min(direct_s)
    decode_step_s = decode_s / decode_steps
    return {
        "processes": group.num_processes,
        "tp": TP,
        "batch": batch,
        "transport": args.transport,
        "decode_steps": decode_steps,
        "decode_step_ms": round(decode_step_s * 1e3, 3),
        "exchange_ms": round(exchange_s * 1e3, 3),
        "agree_min_ms": round(agree_s * 1e3, 3),
        "agreement_ms": round((exchange_s + agree_s) * 1e3, 3),
        "agreement_over_decode": round((exchange_s + agree_s) / decode_step_s, 4),
        "target_over_decode": 0.05,
        "loop_step_ms": round(min(loop_s) * 1e3, 3),
        "direct_step_ms": round(min(direct_s) * 1e3, 3),
        "exposed_ms": round(exposed_s * 1e3, 3),
        "exposed_over_decode": round(exposed_s / decode_step_s, 4),
        "cost_over_decode": round((max(exposed_s, 0.0) + agree_s) / decode_step_s, 4),
        "loop_step_ms_rounds": [round(x * 1e3, 3) for x in loop_s],
        "direct_step_ms_rounds": [round(x * 1e3, 3) for x in direct_s],
        "digest_ms": round(digest_s * 1e3, 3),
        "leak_free": front.leak_free(),
        "note": "CPU figure: two local processes sharing this machine's cores, loopback exchanges, tiny model",
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--transport", choices=("socket", "kv"), default="socket", help="how exchanges travel")
    parser.add_argument("--timeout", type=float, default=600, help="bound on the whole run, seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = _worker(args)
        print(json.dumps(result), flush=True)
        return result
    from kvjax.serve.multihost.launcher import free_port

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryFile("w+") as out0, tempfile.TemporaryFile("w+") as out1:
        return _run(args, env, address, [out0, out1])


def _run(args: argparse.Namespace, env: dict[str, str], address: str, files: list[Any]) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--coordinator", address, "--process-id", str(i)]
            + ["--batch", str(args.batch), "--output-tokens", str(args.output_tokens), "--transport", args.transport],
            env=env,
            cwd=ROOT,
            stdout=files[i],
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = []
    for i, (proc, file) in enumerate(zip(procs, files, strict=True)):
        file.seek(0)
        texts.append(file.read())
        if proc.returncode != 0:
            raise SystemExit(f"process {i} failed ({proc.returncode}):\n{texts[i][-3000:]}")
    result: dict[str, Any] = json.loads(texts[0].strip().splitlines()[-1])
    follower = json.loads(texts[1].strip().splitlines()[-1])
    result["follower_exchange_ms"] = follower["exchange_ms"]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
