"""Prefill/decode disaggregation: what moves between the servers and what it costs. Prints one JSON object.

    python benchmarks/disaggregation.py [--quick] [--repeats N]

* ``transfer``: bytes per second of one array pulled through JAX's transfer servers
  (``KVTransferServer``: two in this process, one offering, one pulling over loopback TCP onto
  the second CPU device) against a device-to-device copy of the same array in this process
  (``jax.device_put`` to the second CPU device), per size (median of ``--repeats`` pulls, each
  from a fresh offer, and the fastest; ``offer_ms`` is the offering side's own cost, not in the
  pull's time). Small arrays measure the pull's fixed cost (a round trip and a thread), large
  ones its bandwidth.
* ``reuse``: the demo's multi-turn chats (``Workload()``'s 4 chats x 3 turns of 48 new tokens and
  16 output tokens; ``--quick``: 2 x 2) served by a `DecodeServer` linked to a `PrefillServer`
  (the tiny model, random weights, pages of 16 tokens), with decode-side prefix reuse on
  (``disaggregation_decode_enable_radix_cache``: a radix tree) and off (``disable_radix_cache``:
  no tree on the decode side). Per turn: the tokens and pages pulled
  per request and the tokens the decode side already held. Goal: with reuse on, a later turn
  pulls only what its own tree lacks: the prompt past the page-aligned part of the previous
  turn's prompt and output (``pulls_only_the_new_turn``); with reuse off, every prompt whole.
* ``ttft``: a request's time to first decoded token split, from the `DecodeServer`'s ``Room``
  timestamps, into ``prefill`` (prefill order sent -> ``Prefilled`` read: queueing and compute on
  the prefill server and the link), ``transfer`` (``Prefilled`` -> the pull landed: admission on
  the decode side, the pull order, the offer and the pull) and ``first_decode`` (pull landed ->
  the first decode step's token read: with the overlap scheduler, one step after it was
  launched); medians over the requests of a measured run (a first run
  compiles every shape). ``pull_only_ms``: the pulls' own time, per pull.

CPU figures on a shared 2-core machine, both servers in one process (the prefill server serving
in a thread): compare ratios and counts, not absolute times across machines.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)  # before the backend starts: a second device to copy to

from benchmarks._common import machine  # noqa: E402
from kvjax import CacheConfig, build_kv_cache  # noqa: E402
from kvjax.disaggregation.decode import DecodeServer, Room  # noqa: E402
from kvjax.disaggregation.kv_transfer import KVTransferServer  # noqa: E402
from kvjax.disaggregation.prefill import PrefillServer  # noqa: E402
from kvjax.serve.model import init_params  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from kvjax.serve.workload import Workload, run_workload  # noqa: E402
from kvjax.spec import ModelSpec  # noqa: E402

SPEC = ModelSpec.preset("tiny")
PAGE = 16
SIZES = (16 << 10, 256 << 10, 4 << 20, 64 << 20)
QUICK_SIZES = (16 << 10, 1 << 20)


# --- transfer ---------------------------------------------------------------------------------------


def transfer_figures(sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    first, second = jax.local_devices()[:2]
    offering, pulling = KVTransferServer(), KVTransferServer()
    transfer_id = 1
    rows = []
    for size in sizes:
        shape = (size // (128 * 2), 128)  # bfloat16
        array = jax.device_put(jnp.ones(shape, jnp.bfloat16), first).block_until_ready()
        struct = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(second))
        pulls, offers, copies = [], [], []
        for i in range(repeats + 1):  # the first of each: a warm-up
            started = time.perf_counter()
            offering.offer(transfer_id, [array])
            offered = time.perf_counter()
            (pulled,) = pulling.pull(offering.address, transfer_id, [struct], timeout_s=60.0)
            done = time.perf_counter()
            offering.drop(transfer_id)
            transfer_id += 1
            assert pulled.shape == shape and pulled.devices() == {second}
            started_copy = time.perf_counter()
            jax.device_put(array, second).block_until_ready()
            copied = time.perf_counter()
            if i:
                offers.append(offered - started)
                pulls.append(done - offered)
                copies.append(copied - started_copy)
        pull, copy = statistics.median(pulls), statistics.median(copies)
        rows.append(
            {
                "bytes": size,
                "pull_ms": round(pull * 1e3, 3),
                "offer_ms": round(statistics.median(offers) * 1e3, 3),
                "device_put_ms": round(copy * 1e3, 3),
                "pull_ms_min": round(min(pulls) * 1e3, 3),
                "device_put_ms_min": round(min(copies) * 1e3, 3),
                "pull_mb_per_s": round(size / pull / 1e6, 1),
                "device_put_mb_per_s": round(size / copy / 1e6, 1),
                "pull_over_device_put_time": round(pull / copy, 2),
            }
        )
    return rows


# --- serving: reuse and time to first token -------------------------------------------------------


class RoomRecorder:
    """The decode server as ``run_workload``'s front, keeping every request's ``Room`` (the server
    forgets a room when its request ends)."""

    def __init__(self, server: DecodeServer) -> None:
        self.server = server
        self.rooms: dict[str, Room] = {}

    def submit(self, reqs: list[ServingReq]) -> None:
        self.server.submit(reqs)
        for req in reqs:
            self.rooms[str(req.rid)] = self.server.rooms[req.rid]

    def step(self) -> list[ServingReq]:
        return self.server.step()

    @property
    def idle(self) -> bool:
        return bool(self.server.idle)


def _scheduler(params: Any, mode: str, reuse: bool, workload: Workload) -> Scheduler:
    context = -(-(workload.longest_request_tokens + PAGE) // PAGE) * PAGE
    config = CacheConfig(
        context_length=context,
        page_size=PAGE,
        max_total_tokens=8 * context,
        chunked_prefill_size=256,
        disaggregation_mode=mode,
        disaggregation_decode_enable_radix_cache=reuse and mode == "decode",
        disable_radix_cache=not reuse and mode == "decode",  # no tree: nothing held across turns
    )
    return Scheduler(SPEC, build_kv_cache(SPEC, config), params, max_batch_size=8)


def serve(params: Any, workload: Workload, reuse: bool) -> dict[str, Any]:
    """The workload through a decode server and a prefill server (serving in a thread)."""
    secret = secrets.token_hex(32)
    prefill = PrefillServer(_scheduler(params, "prefill", False, workload), fingerprint="tiny", secret=secret)
    stop = threading.Event()
    thread = threading.Thread(target=prefill.serve, args=(stop.is_set, 0.001), daemon=True)
    thread.start()
    try:
        decode = DecodeServer(
            _scheduler(params, "decode", reuse, workload),
            fingerprint="tiny",
            prefill=[prefill.address],
            secret=secret,
            timeout_s=120.0,
        )
        front = RoomRecorder(decode)
        started = time.perf_counter()
        outputs = run_workload(front, workload)  # type: ignore[arg-type]  # a ServingFront in all it uses
        seconds = time.perf_counter() - started
        leak_free = decode.leak_free()
        failed = [str(r.rid) for r in decode.failed]
        decode.close()
    finally:
        stop.set()
        thread.join(30)
        prefill.close()
    return {
        "outputs": outputs,
        "rooms": front.rooms,
        "seconds": seconds,
        "leak_free": leak_free,
        "failed": failed,
        "pulls": decode.pulls,
        "pull_seconds": decode.transfer_seconds,
        "prefill_snapshots_left": len(prefill.snapshots),
    }


def _turn(rid: str) -> tuple[int, int]:
    chat, turn = rid[1:].split(".")
    return int(chat), int(turn)


def reuse_figures(run: dict[str, Any], reuse: bool) -> dict[str, Any]:
    rooms: dict[str, Room] = run["rooms"]
    outputs: dict[str, list[int]] = run["outputs"]
    per_turn: dict[int, list[Room]] = {}
    only_new = True
    for rid, room in rooms.items():
        chat, turn = _turn(rid)
        per_turn.setdefault(turn, []).append(room)
        if reuse and turn:
            before = rooms[f"c{chat}.{turn - 1}"]
            held = (before.prompt + len(outputs[f"c{chat}.{turn - 1}"]) - 1) // PAGE * PAGE
            only_new &= room.pulled_tokens == room.prompt - held
        elif not reuse:
            only_new &= room.pulled_tokens == room.prompt
    turns = {}
    for turn, group in sorted(per_turn.items()):
        turns[str(turn)] = {
            "requests": len(group),
            "prompt_tokens_mean": statistics.mean(r.prompt for r in group),
            "pulled_tokens_mean": statistics.mean(r.pulled_tokens for r in group),
            "pulled_pages_mean": statistics.mean(-(-r.pulled_tokens // PAGE) for r in group),
            "held_tokens_mean": statistics.mean(r.reused_tokens for r in group),
        }
    pulled = sum(r.pulled_tokens for r in rooms.values())
    return {
        "per_turn": turns,
        "pulled_tokens": pulled,
        "pulled_pages": sum(-(-r.pulled_tokens // PAGE) for r in rooms.values()),
        "held_tokens": sum(r.reused_tokens for r in rooms.values()),
        "prompt_tokens": sum(r.prompt for r in rooms.values()),
        ("pulls_only_the_new_turn" if reuse else "pulls_every_prompt_whole"): only_new,
        "seconds": round(run["seconds"], 3),
        "failed": run["failed"],
        "leak_free": run["leak_free"],
        "prefill_snapshots_left": run["prefill_snapshots_left"],
    }


def ttft_figures(run: dict[str, Any]) -> dict[str, Any]:
    rooms = [r for r in run["rooms"].values() if r.decoded_at]
    ms = lambda values: round(statistics.median(values) * 1e3, 3)  # noqa: E731
    prefill = [r.prefilled_at - r.ordered_at for r in rooms]
    transfer = [r.pulled_at - r.prefilled_at for r in rooms]
    first_decode = [r.decoded_at - r.pulled_at for r in rooms]
    return {
        "requests": len(rooms),
        "median_ms": {
            "prefill": ms(prefill),
            "transfer": ms(transfer),
            "first_decode": ms(first_decode),
            "ttft": ms([r.decoded_at - r.ordered_at for r in rooms]),
        },
        "pull_only_ms": round(run["pull_seconds"] / max(run["pulls"], 1) * 1e3, 3),
        "pulls": run["pulls"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer sizes and a smaller workload")
    parser.add_argument("--repeats", type=int, default=20, help="pulls per size")
    args = parser.parse_args()
    workload = Workload(groups=0, chats=2, turns=2) if args.quick else Workload(groups=0)
    params = init_params(SPEC, seed=0)
    started = time.perf_counter()
    transfer = transfer_figures(QUICK_SIZES if args.quick else SIZES, args.repeats)
    serve(params, workload, reuse=True)  # compiles every step shape of both servers
    runs = {reuse: serve(params, workload, reuse) for reuse in (True, False)}
    on, off = reuse_figures(runs[True], True), reuse_figures(runs[False], False)
    report = {
        "benchmark": "disaggregation",
        "note": "CPU figures (both servers in one process, loopback TCP, a shared 2-core machine)",
        "transfer": transfer,
        "reuse": {
            "workload": {k: v for k, v in vars(workload).items() if k in ("chats", "turns", "turn_tokens")}
            | {"output_tokens": workload.output_tokens, "page_size": PAGE},
            "on": on,
            "off": off,
            "pulled_pages_on_over_off": round(on["pulled_pages"] / off["pulled_pages"], 3),
            "outputs_identical": runs[True]["outputs"] == runs[False]["outputs"],
        },
        "ttft": {"reuse_on": ttft_figures(runs[True]), "reuse_off": ttft_figures(runs[False])},
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
