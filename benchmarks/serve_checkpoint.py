"""Serving a checkpoint directory: warm against cold, and what kvjax's host bookkeeping costs per
decode step next to the jitted step.

A tiny checkpoint (the ``tiny`` preset's seed-0 weights written as ``config.json`` +
``model.safetensors``) is loaded with ``load_checkpoint``, then:

* **warm vs cold**: the demo workload (shared system prompts, multi-turn chats) served with the
  radix cache disabled (cold) and enabled (warm), after one run that compiles every step shape;
  generated tokens per second of each, median of ``--repeats`` interleaved runs; the warm run
  also without overlap scheduling (``warm_no_overlap``).
* **bookkeeping per decode step** at batch 16 and 64: that many requests (a shared 64-token
  prefix plus 16 tokens of their own) decode ``--decode-tokens`` tokens together, with overlap
  scheduling off (``overlap_off``) and on (``overlap_on``), interleaved. Per decode step, the
  scheduler's host time is split into bookkeeping (evict, ``alloc_decode``, request-table
  writes, caching and freeing finished requests), batch packing (page table and device inputs)
  and the jitted step (dispatch, and the wait until its tokens are on the host);
  ``finish_us_per_step`` is the part of bookkeeping spent finishing the requests (the tree insert
  of prompt + output, once per request, spread over the decode steps; with overlap these
  requests, which all end on ``max_new_tokens``, are finished by the last scheduler step, which
  launches no decode, so it reads 0 there). Target without overlap: bookkeeping at most 10% of
  the step.
* **exposed host time** per decode step: the time during which no step is in flight on the
  device, so the device waits for the host. Measured directly, on separate runs of each mode
  traced by ``jax.profiler`` (runtime events only, no Python tracer): step ``k`` is in flight from
  the moment the runtime has queued it (``DISPATCH_EVENT`` ends on the host thread) until its
  computation ends (``COMPLETION_EVENT``); the exposed time of step ``k`` is ``max(0, dispatch of
  k - end of k - 1)``. ``exposed_host_us_per_step`` is its mean over the decode phase,
  ``device_busy_us_per_step`` the mean time from ``max(end of k - 1, dispatch of k)`` to the end
  of ``k`` (the step as it ran in the loop, slowed by whatever shared its cores), and
  ``exposed_host_over_step`` their ratio (median over runs; ``..._per_run`` lists every run);
  ``exposed_step_fraction`` the share of steps with a gap, ``largest_exposed_us`` the longest.
  The host's side of a gap: ``read_return_us_per_step``, how long after its step ended a blocked
  token read returns (waking the Python thread, and its wait for a core), and
  ``host_work_wall_us_per_step``, the wall time from a read's return to the next dispatch.
  Target with overlap: at most 0.05. ``tokens_per_second`` is from the untraced runs (the
  traced runs' figure, ``tokens_per_second_traced``, shows what tracing costs).
  Where the host's time goes, from CPU clocks that do not count time spent waiting for a core:
  ``host_cpu_us_per_step`` is the Python thread's CPU time per decode step (all of kvjax's host
  work, packing, dispatch and the read), ``process_cpu_us_per_step`` adds the runtime's threads
  (the "device"), ``cores_used`` is process CPU time over wall time. On a CPU the "device" is
  cores the host also needs: while a step computes on every core, the host thread waits for a
  core, and its work (and the dispatch) takes several times its CPU time in wall time. So the
  exposed time on a CPU says how the two shared the cores, not what the host costs next to an
  accelerator; ``exposed_host_over_step_separate_cores`` estimates that: with overlap
  ``max(0, host CPU - device step) / device step``, without ``host CPU / device step`` (the
  device step being ``device_step_us``, the run's last decode step replayed ``CHAIN`` times back
  to back with the pools chained and no host work in between). ``--separate-cores`` measures
  it instead: XLA's threads on the last CPU, the Python thread on the others (other processes
  still share them).
  ``runtime_threads_busy`` counts the process's threads other than the Python thread that used
  at least 5% of its CPU time over the measured runs (Linux), the "device" threads the step ran
  on; ``python_thread_cpu_share`` is the Python thread's part of that CPU time and
  ``cpu_share_by_thread_name`` every thread's part by its name (the runtime's threads are named
  by XLA; unnamed ones carry the interpreter's name).
* **device threads** (``--device-threads N``): on a TPU the device's compute does not run on the
  host's cores. To come nearer to that on a CPU, the bookkeeping and exposed-time measurement is
  run a second time in a child process whose XLA:CPU runtime has ``N`` compute threads (``NPROC=N``
  in its environment before the backend starts: XLA sizes its intra-op thread pool from it; jax
  0.10 ignores ``--xla_cpu_multi_thread_eigen=false``), so with ``N = 1`` on a 2-core machine the
  step computes on one core and leaves the other to the Python thread (other processes still share
  them). Reported beside the default mode as ``decode_bookkeeping_device_threads``; ``modes``
  labels both. Its step is slower (one core instead of all), so its ratios are over a longer
  step. Both are CPU figures: neither is a TPU figure.
  Each batch runs ``--repeats`` times per mode and per kind (untraced, traced), after a compiling
  run per mode; medians are reported.

Prints one JSON object. CPU figures are not TPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._common import machine  # noqa: E402
from kvjax import CacheConfig, ModelSpec, build_kv_cache  # noqa: E402
from kvjax.demo import serve  # noqa: E402
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint, save_checkpoint  # noqa: E402
from kvjax.serve.model import init_params  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from kvjax.serve.workload import Workload  # noqa: E402

TARGET_BOOKKEEPING_OVER_STEP = 0.10
TARGET_EXPOSED_WITH_OVERLAP = 0.05
CHAIN = 16
# The runtime's trace events (jax 0.10, XLA:CPU): the host queues an execution at the end of the
# first; the second ends when the execution's computation has finished.
DISPATCH_EVENT = "CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice"
COMPLETION_EVENT = "ThunkExecutor::Execute (wait for completion)"
READ_EVENT = "serve_checkpoint.read"  # the scheduler's read of a step's tokens (annotated here)


def warm_vs_cold(model: LoadedModel, workload: Workload, repeats: int) -> dict:
    settings: dict[str, Any] = dict(page_size=16, max_total_tokens=16384, chunked_prefill_size=512)
    serve(workload, model=model, disable_radix_cache=True, **settings)  # compile every step shape
    serve(workload, model=model, **settings)  # and the warm run's (prefix hits give other shapes)
    rates: dict[str, list[float]] = {"cold": [], "warm": [], "warm_no_overlap": []}
    outputs: dict[str, dict] = {}
    modes: tuple[tuple[str, dict[str, Any]], ...] = (
        ("cold", dict(disable_radix_cache=True)),
        ("warm", {}),
        ("warm_no_overlap", dict(overlap=False)),
    )
    for _ in range(repeats):
        for mode, extra in modes:
            start = time.perf_counter()
            sched, out = serve(workload, model=model, **settings, **extra)
            rates[mode].append(sched.stats.generated_tokens / (time.perf_counter() - start))
            outputs[mode] = out
    cold, warm = statistics.median(rates["cold"]), statistics.median(rates["warm"])
    return {
        "cold_tokens_per_second": round(cold, 1),
        "warm_tokens_per_second": round(warm, 1),
        "warm_over_cold": round(warm / cold, 3),
        "warm_no_overlap_tokens_per_second": round(statistics.median(rates["warm_no_overlap"]), 1),
        "outputs_identical": outputs["cold"] == outputs["warm"] == outputs["warm_no_overlap"],
    }


def _decode_run(
    model: LoadedModel, config: CacheConfig, prompts: list, decode_tokens: int, overlap: bool, traced: bool
) -> dict:
    """One run: prefill every request, then time the decode phase alone (``traced``: under the
    profiler, for the device timeline; see ``_exposed_host``)."""
    batch = len(prompts)
    cache = build_kv_cache(model.spec, config)
    sched = Scheduler(
        model.config, cache, model.params, max_batch_size=batch, chunked_prefill_size=batch * 80, overlap=overlap
    )
    step_fn = sched.step_fn
    last_inputs: list[tuple] = []

    def recording_step(pools: Any, params: dict, *inputs: Any) -> tuple:
        last_inputs[:] = [inputs]
        return step_fn(pools, params, *inputs)

    sched.step_fn = recording_step
    read_arrays = sched.read_arrays

    def annotated_read(tokens: Any, logits: Any) -> tuple:
        with jax.profiler.TraceAnnotation(READ_EVENT):
            return read_arrays(tokens, logits)

    sched.read_arrays = annotated_read  # type: ignore[method-assign]
    sched.submit([ServingReq(i, p, max_new_tokens=decode_tokens) for i, p in enumerate(prompts)])
    while sched.waiting or sched.chunked is not None:
        sched.step()
    sched.resolve()  # the decode phase starts with the prefill's tokens on the host
    st = sched.stats
    generated_before = st.generated_tokens
    with tempfile.TemporaryDirectory() as trace_dir:
        if traced:
            options = jax.profiler.ProfileOptions()
            options.host_tracer_level = 1  # runtime events only
            options.python_tracer_level = 0  # no per-function Python events
            jax.profiler.start_trace(trace_dir, profiler_options=options)
        start, cpu_start, process_start = time.perf_counter(), time.thread_time(), time.process_time()
        while not sched.idle:
            sched.step()
        wall = time.perf_counter() - start
        host_cpu, process_cpu = time.thread_time() - cpu_start, time.process_time() - process_start
        if traced:
            jax.profiler.stop_trace()
            exposed = _exposed_host(trace_dir, st.decode_steps)
    assert sched.leak_free()
    steps = st.decode_steps
    run = {
        "outputs": [r.output_ids for r in sorted(sched.finished, key=lambda r: r.rid)],
        "decode_steps": steps,
        "loop_us_per_step": 1e6 * wall / steps,
        "bookkeeping_us_per_step": 1e6 * st.decode_bookkeeping_seconds / steps,
        "pack_us_per_step": 1e6 * st.decode_pack_seconds / steps,
        "step_us_per_step": 1e6 * st.decode_step_seconds / steps,
        "wait_us_per_step": 1e6 * st.decode_wait_seconds / steps,
        "finish_us_per_step": 1e6 * st.decode_finish_seconds / steps,
        "bookkeeping_over_step": st.decode_bookkeeping_seconds / st.decode_step_seconds,
        "bookkeeping_without_finishing_over_step": (st.decode_bookkeeping_seconds - st.decode_finish_seconds)
        / st.decode_step_seconds,
        "bookkeeping_and_pack_over_step": (st.decode_bookkeeping_seconds + st.decode_pack_seconds)
        / st.decode_step_seconds,
        "tokens_per_second": (st.generated_tokens - generated_before) / wall,
        "host_cpu_us_per_step": 1e6 * host_cpu / steps,
        "process_cpu_us_per_step": 1e6 * process_cpu / steps,
        "cores_used": process_cpu / wall,
        "device_step_us": _chained_step_us(sched, step_fn, last_inputs[0]),
    }
    if traced:
        run.update(exposed)
    return run


def _exposed_host(trace_dir: str, steps: int) -> dict[str, float]:
    """The device timeline of a traced decode phase: per step, the time no step was in flight.

    Step ``k`` is dispatched when the runtime has queued it (the end of the host's
    ``DISPATCH_EVENT``) and done when its computation ends (the end of ``COMPLETION_EVENT``; steps
    on one device complete in dispatch order). The device waits for the host from the end of step
    ``k - 1`` to the dispatch of step ``k`` when that dispatch comes later: that interval is the
    exposed host time. The step's device time runs from ``max(end of k - 1, dispatch of k)`` to its
    end (on a CPU it includes waking the runtime's threads and the slowdown from sharing the cores
    with the host). The first step of the phase is left out (its predecessor is the prefill)."""
    path = next(Path(trace_dir).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(path))
    events: dict[str, list[tuple[int, int]]] = {DISPATCH_EVENT: [], COMPLETION_EVENT: [], READ_EVENT: []}
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in events:
                    events[event.name].append((event.start_ns, event.end_ns))
    dispatched = sorted(end for _, end in events[DISPATCH_EVENT])
    completed = sorted(end for _, end in events[COMPLETION_EVENT])
    reads = sorted(events[READ_EVENT])
    if not len(dispatched) == len(completed) == len(reads) == steps:
        raise RuntimeError(
            f"the trace has {len(dispatched)} dispatches, {len(completed)} completions and {len(reads)} reads for "
            f"{steps} decode steps: this jax version names its runtime events differently; update DISPATCH_EVENT, "
            "COMPLETION_EVENT and READ_EVENT"
        )
    exposed = [max(0, dispatched[k] - completed[k - 1]) for k in range(1, steps)]
    busy = sum(completed[k] - max(dispatched[k], completed[k - 1]) for k in range(1, steps))
    # The host's side of each gap: how late a blocked read returns after its step has ended
    # (waking the host thread, and its wait for a core), then the host's work until the next
    # dispatch (from the last read before it).
    woken = [end - max(start, done) for (start, end), done in zip(reads, completed, strict=True)]
    read_ends = [end for _, end in reads]
    work = [d - max(e for e in read_ends if e < d) for d in dispatched[1:] if read_ends[0] < d]
    n = steps - 1
    return {
        "exposed_host_us_per_step": sum(exposed) / 1e3 / n,
        "device_busy_us_per_step": busy / 1e3 / n,
        "exposed_host_over_step": sum(exposed) / busy,
        "exposed_step_fraction": sum(1 for e in exposed if e > 0) / n,
        "largest_exposed_us": max(exposed) / 1e3,
        "read_return_us_per_step": sum(woken) / 1e3 / steps,
        "host_work_wall_us_per_step": sum(work) / 1e3 / max(1, len(work)),
    }


def _chained_step_us(sched: Scheduler, step_fn: Any, inputs: tuple) -> float:
    """Microseconds per step of ``step_fn`` on ``inputs`` (a decode step's), ``CHAIN`` calls back
    to back with the pools chained (after one that it waits for), then one wait for the last."""
    out = step_fn(sched.cache.pools, sched.params, *inputs)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(CHAIN):
        out = step_fn(out[0], sched.params, *inputs)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - start) / CHAIN
    sched.cache.set_pools(out[0])
    return 1e6 * seconds


def decode_bookkeeping(model: LoadedModel, batch: int, decode_tokens: int, repeats: int) -> dict:
    rng = np.random.default_rng(batch)
    shared = rng.integers(0, model.config.vocab_size, 64).tolist()
    prompts = [shared + rng.integers(0, model.config.vocab_size, 16).tolist() for _ in range(batch)]
    config = CacheConfig(
        page_size=16,
        max_total_tokens=batch * (96 + decode_tokens) + 1024,
        max_running_requests=batch,
        context_length=256,
        chunked_prefill_size=batch * 80,
    )
    runs: dict[bool, list[dict]] = {False: [], True: []}
    traced: dict[bool, list[dict]] = {False: [], True: []}
    _decode_run(model, config, prompts, decode_tokens, False, False)  # compiles
    _decode_run(model, config, prompts, decode_tokens, True, False)
    ticks_before = _thread_cpu_ticks()
    for _ in range(repeats):
        for overlap in (False, True):
            runs[overlap].append(_decode_run(model, config, prompts, decode_tokens, overlap, False))
            traced[overlap].append(_decode_run(model, config, prompts, decode_tokens, overlap, True))
    threads = _busy_threads(ticks_before, _thread_cpu_ticks())
    result: dict[str, Any] = {
        "batch": batch,
        "decode_steps": runs[False][0]["decode_steps"],
        "outputs_identical": all(
            r["outputs"] == runs[False][0]["outputs"] for r in runs[False] + runs[True] + traced[False] + traced[True]
        ),
    }
    # The same computation in both modes (overlap adds one gather of the input ids): pooled.
    all_runs = runs[False] + runs[True] + traced[False] + traced[True]
    device_us = statistics.median(r["device_step_us"] for r in all_runs)
    result["device_step_us"] = round(device_us, 1)
    for overlap, name in ((False, "overlap_off"), (True, "overlap_on")):
        mode: dict[str, Any] = {}
        for key in runs[overlap][0]:
            if key not in ("outputs", "decode_steps", "device_step_us"):
                value = statistics.median(r[key] for r in runs[overlap])
                mode[key] = round(value, 4 if key.endswith("_over_step") or key == "cores_used" else 1)
        for key in traced[overlap][0]:
            if key not in runs[overlap][0]:
                value = statistics.median(r[key] for r in traced[overlap])
                mode[key] = round(value, 4 if key.endswith(("_over_step", "_fraction")) else 1)
        mode["exposed_host_over_step_per_run"] = [round(r["exposed_host_over_step"], 4) for r in traced[overlap]]
        mode["tokens_per_second_traced"] = round(statistics.median(r["tokens_per_second"] for r in traced[overlap]), 1)
        # Host and device on cores of their own: the host's work per step is its CPU time, the
        # step's is the replay's; overlap hides the smaller, without overlap they add up.
        host_cpu = mode["host_cpu_us_per_step"]
        exposed_alone = max(0.0, host_cpu - device_us) if overlap else host_cpu
        mode["exposed_host_over_step_separate_cores"] = round(exposed_alone / device_us, 4)
        result[name] = mode
    result["meets_bookkeeping_target"] = result["overlap_off"]["bookkeeping_over_step"] <= TARGET_BOOKKEEPING_OVER_STEP
    result["meets_exposed_target_with_overlap"] = (
        result["overlap_on"]["exposed_host_over_step"] <= TARGET_EXPOSED_WITH_OVERLAP
    )
    result["overlap_speedup"] = round(
        result["overlap_on"]["tokens_per_second"] / result["overlap_off"]["tokens_per_second"], 3
    )
    result.update(threads)
    return result


def _thread_cpu_ticks() -> dict[int, tuple[str, int]]:
    """Name and CPU time (user + system, in clock ticks) of every thread of this process by its
    id, from ``/proc/self/task`` (Linux; empty elsewhere)."""
    ticks: dict[int, tuple[str, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return ticks
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 1 :].split()
        ticks[int(tid)] = (name, int(fields[11]) + int(fields[12]))  # utime, stime
    return ticks


def _busy_threads(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, Any]:
    """Which threads did the work between two ``_thread_cpu_ticks``: the runtime's threads (all
    but this Python thread) that used at least 5% of the process's CPU time, this thread's share
    of it, and every thread's share by thread name (those of at least 1%)."""
    used = {tid: (name, t - before.get(tid, (name, 0))[1]) for tid, (name, t) in after.items()}
    total = sum(t for _, t in used.values())
    if not total:
        return {"runtime_threads_busy": None, "python_thread_cpu_share": None, "cpu_share_by_thread_name": None}
    me = threading.get_native_id()
    busy = sum(1 for tid, (_, t) in used.items() if tid != me and t >= 0.05 * total)
    by_name: dict[str, float] = {}
    for tid, (name, t) in used.items():
        key = "this Python thread" if tid == me else name
        by_name[key] = by_name.get(key, 0.0) + t / total
    return {
        "runtime_threads_busy": busy,
        "python_thread_cpu_share": round(used.get(me, ("", 0))[1] / total, 3),
        "cpu_share_by_thread_name": {
            k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v >= 0.01
        },
    }


def _separate_cores() -> dict[str, list[int]]:
    """Give the "device" (XLA:CPU's threads) and the host (this thread) CPUs of their own: the
    runtime's thread pools are created with the backend and inherit the affinity of the thread
    that creates them, so the backend is started while this thread is pinned to the last CPU,
    and this thread then moves to the others. The nearest a CPU gets to a host beside an
    accelerator (other processes still share the CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--separate-cores needs at least 2 CPUs; this process may use {cpus}")
    os.sched_setaffinity(0, cpus[-1:])
    jax.devices()  # creates the CPU client and its threads here
    os.sched_setaffinity(0, cpus[:-1])
    return {"device_cpus": cpus[-1:], "host_cpus": cpus[:-1]}


def _device_threads_mode(threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """The bookkeeping measurement in a child process whose XLA:CPU runtime has ``threads``
    compute threads (``NPROC``, read when the backend starts; module docstring)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--decode-only"]
    cmd += ["--repeats", str(args.repeats), "--decode-tokens", str(args.decode_tokens)]
    if args.separate_cores:
        cmd.append("--separate-cores")
    env = {**os.environ, "NPROC": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the --device-threads {threads} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"device_threads": threads, **json.loads(proc.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a smaller demo workload")
    parser.add_argument(
        "--separate-cores",
        action="store_true",
        help="run XLA's threads on the last CPU and the Python thread on the others (Linux)",
    )
    parser.add_argument(
        "--device-threads",
        type=int,
        default=None,
        metavar="N",
        help="also measure decode bookkeeping and exposed host time with XLA:CPU limited to N compute threads "
        "(a child process with NPROC=N), so the 'device' and the Python thread do not share a core; both modes "
        "are reported",
    )
    parser.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)  # the child of --device-threads
    args = parser.parse_args()
    if args.device_threads is not None and args.device_threads < 1:
        parser.error(f"--device-threads must be at least 1, got {args.device_threads}")
    cores = _separate_cores() if args.separate_cores else None
    spec = ModelSpec.preset("tiny")
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(directory, spec, init_params(spec))
        model = load_checkpoint(directory)
    batches = (16, 64)
    if args.decode_only:
        decode = [decode_bookkeeping(model, b, args.decode_tokens, args.repeats) for b in batches]
        print(json.dumps({"runs": decode, "load_average": [round(x, 2) for x in os.getloadavg()]}))
        return
    workload = Workload(groups=2, prompts_per_group=3, chats=2, turns=2) if args.quick else Workload()
    report: dict[str, Any] = {
        "benchmark": "serve_checkpoint",
        "model": "tiny checkpoint (config.json + model.safetensors, float32)",
        "workload_requests": workload.num_requests,
        "repeats": args.repeats,
        "warm_vs_cold": warm_vs_cold(model, workload, args.repeats),
        "decode_bookkeeping": [decode_bookkeeping(model, b, args.decode_tokens, args.repeats) for b in batches],
    }
    if args.device_threads is not None:
        report["decode_bookkeeping_device_threads"] = _device_threads_mode(args.device_threads, args)
        report["modes"] = {
            "decode_bookkeeping": "XLA:CPU's default threads (one per core): the 'device' and the host Python "
            "thread share every core",
            "decode_bookkeeping_device_threads": f"XLA:CPU limited to {args.device_threads} compute thread(s) "
            "(NPROC): the 'device' and the host Python thread do not compete for one core (other processes "
            "still share them); a CPU, not a TPU",
        }
    report.update(
        {
            "target_bookkeeping_over_step": TARGET_BOOKKEEPING_OVER_STEP,
            "target_exposed_host_over_step_with_overlap": TARGET_EXPOSED_WITH_OVERLAP,
            "note": "CPU figures (in the default mode the host and the 'device' share the same cores), not TPU figures",
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "separate_cores": cores,
            "machine": machine(),
        }
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
