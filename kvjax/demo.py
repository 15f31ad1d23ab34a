"""The main job (``python -m kvjax demo``): plan and build a KV cache for the tiny model, then drive it.

The workload runs batches of requests through the same steps a serving loop takes: a request
row, ``alloc_extend`` for the prompt, K/V written into every layer by one jitted step with the
pools donated (in place), ``alloc_decode`` and a write per generated token, a read-back of every
token's K/V from the pages the request table points at, and the release of everything at the end.
The report checks that every value read back is the value written and that nothing leaked.

K/V values are a pure function of (layer, token position, request), so they can be checked
without keeping copies.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.build import KVCache, build_kv_cache
from kvjax.config import CacheConfig
from kvjax.pools import CachePools
from kvjax.spec import ModelSpec

DEMO_MODEL = "tiny"
BATCH = 8
DECODE_STEPS = 16


@dataclass
class DemoReport:
    """What the demo did and whether it held together. Token counts are totals over the workload."""

    model: str
    platform: str
    requests: int
    prompt_tokens: int
    generated_tokens: int
    kv_tokens_written: int
    tokens_per_second: float
    peak_pool_occupancy: float
    pool_tokens: int
    pool_bytes: int
    readback_ok: bool
    leak_free: bool
    plan_text: str

    @property
    def ok(self) -> bool:
        return self.readback_ok and self.leak_free

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("plan_text")
        d["ok"] = self.ok
        return d

    def __str__(self) -> str:
        return "\n".join(
            [
                self.plan_text,
                "",
                f"workload on {self.platform}: {self.requests} requests, {self.prompt_tokens:,} prompt tokens, "
                f"{self.generated_tokens:,} generated tokens",
                f"  K/V written: {self.kv_tokens_written:,} tokens x all layers, {self.tokens_per_second:,.0f} tokens/s",
                f"  peak pool occupancy: {self.peak_pool_occupancy:.1%} of {self.pool_tokens:,} tokens "
                f"({self.pool_bytes / 2**20:.1f} MiB)",
                f"  read-back of every token's K/V: {'ok' if self.readback_ok else 'MISMATCH'}",
                f"  leak check (available == capacity, request rows all free): {'ok' if self.leak_free else 'LEAK'}",
            ]
        )


def _kv_values(spec: ModelSpec, layer: int, positions: jax.Array, rid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Deterministic K and V for tokens at ``positions`` of requests ``rid`` (a scalar or one per token).

    Values are small integers, exact in every float dtype the tiny model may use.
    """
    h = jnp.arange(spec.num_kv_heads, dtype=jnp.float32)[None, :, None]
    dk = jnp.arange(spec.head_dim, dtype=jnp.float32)[None, None, :]
    dv = jnp.arange(spec.v_head_dim, dtype=jnp.float32)[None, None, :]
    base = (positions.astype(jnp.float32) + 256.0 * rid.astype(jnp.float32))[:, None, None]
    k = jnp.fmod(base + 7.0 * h + dk + 3.0 * layer, 251.0)
    v = -jnp.fmod(base + 5.0 * h + dv + 11.0 * layer, 241.0)
    return k, v


def _make_write_step(spec: ModelSpec):
    """One jitted step writing K/V of a token bucket into every layer, with the pools donated."""

    def step(pools: CachePools, loc: jax.Array, positions: jax.Array, rids: jax.Array) -> CachePools:
        kv = pools.kv
        for layer in range(kv.num_layers):
            k, v = _kv_values(spec, layer, positions, rids)
            kv = kv.set_kv_buffer(kv.start_layer + layer, loc, k, v)
        return pools.replace(kv=kv)

    return jax.jit(step, donate_argnums=0)


def _bucket(n: int) -> int:
    """Pad token counts to powers of two so the step compiles a handful of times."""
    return max(16, 1 << (n - 1).bit_length())


def run_demo(
    *, num_requests: int = 32, page_size: int = 16, max_total_tokens: int = 8192, seed: int = 0, progress: bool = True
) -> DemoReport:
    """Build the tiny model's cache on the default device and run the workload; see the module docstring."""
    cache = demo_cache(page_size=page_size, max_total_tokens=max_total_tokens)
    spec = ModelSpec.preset(DEMO_MODEL)
    rng = np.random.default_rng(seed)
    write = _make_write_step(spec)
    alloc, rows = cache.allocator, cache.req_to_token_pool
    pools = cache.pools

    prompt_tokens = generated = written = 0
    peak_used = 0
    readback_ok = True
    elapsed = 0.0
    batches = [list(range(i, min(i + BATCH, num_requests))) for i in range(0, num_requests, BATCH)]
    bar = _progress(progress, len(batches))
    for batch in batches:
        lens = rng.integers(16, 300, size=len(batch))
        req_rows = rows.alloc(len(batch))
        if req_rows is None:
            raise RuntimeError("request table full: lower the batch or raise max_running_requests")
        zeros = np.zeros(len(batch), np.int64)
        loc = alloc.alloc_extend(zeros, lens, np.full(len(batch), -1))
        if loc is None:
            raise RuntimeError(
                f"pool of {alloc.size} tokens cannot hold the prompts ({int(lens.sum())} tokens): "
                "raise --max-total-tokens"
            )
        offsets = np.concatenate([[0], np.cumsum(lens)])
        for i, r in enumerate(req_rows):
            rows.write(r, 0, loc[offsets[i] : offsets[i + 1]])
        positions = np.concatenate([np.arange(n) for n in lens])
        rids = np.repeat(np.asarray(batch), lens)
        t0 = time.perf_counter()
        pools = _write(write, pools, loc, positions, rids)
        seq = lens.copy()
        for _ in range(DECODE_STEPS):
            last = np.array([rows.req_to_token[r, s - 1] for r, s in zip(req_rows, seq)])
            seq = seq + 1
            new = alloc.alloc_decode(seq, last)
            if new is None:
                raise RuntimeError("pool exhausted during decode: raise --max-total-tokens")
            for r, s, slot in zip(req_rows, seq, new):
                rows.write(r, int(s) - 1, np.array([slot]))
            pools = _write(write, pools, new, seq - 1, np.asarray(batch))
        jax.block_until_ready(pools)
        elapsed += time.perf_counter() - t0
        prompt_tokens += int(lens.sum())
        generated += DECODE_STEPS * len(batch)
        written += int(seq.sum())
        peak_used = max(peak_used, alloc.size - alloc.available_size())

        for r, rid, s in zip(req_rows, batch, seq):
            slots = rows.read(r, 0, int(s))
            readback_ok &= _check_readback(spec, pools, slots, rid)
            alloc.free(slots)
        rows.free(req_rows)
        bar.advance()
    bar.close()

    cache = cache.with_pools(pools)
    leak_free = alloc.available_size() == alloc.size and rows.available_size() == cache.plan.max_running_requests
    return DemoReport(
        model=spec.name,
        platform=cache.plan.platform,
        requests=num_requests,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        kv_tokens_written=written,
        tokens_per_second=written / elapsed if elapsed else 0.0,
        peak_pool_occupancy=peak_used / alloc.size,
        pool_tokens=alloc.size,
        pool_bytes=cache.pools.kv.nbytes(),
        readback_ok=bool(readback_ok),
        leak_free=bool(leak_free),
        plan_text=str(cache.plan),
    )


def _write(step, pools: CachePools, loc: np.ndarray, positions: np.ndarray, rids: np.ndarray) -> CachePools:
    """Pad a token batch to its bucket (padding writes go to slot 0, the trash page) and run the step."""
    n = len(loc)
    size = _bucket(n)
    pad = size - n
    loc = np.concatenate([loc, np.zeros(pad, loc.dtype)]).astype(np.int32)
    positions = np.concatenate([positions, np.zeros(pad, np.int64)]).astype(np.int32)
    rids = np.concatenate([rids, np.zeros(pad, np.int64)]).astype(np.int32)
    return step(pools, jnp.asarray(loc), jnp.asarray(positions), jnp.asarray(rids))


def _check_readback(spec: ModelSpec, pools: CachePools, slots: np.ndarray, rid: int) -> bool:
    positions = jnp.arange(len(slots))
    for layer in range(pools.kv.num_layers):
        k, v = pools.kv.get_kv(pools.kv.start_layer + layer, slots)
        want_k, want_v = _kv_values(spec, layer, positions, jnp.int32(rid))
        if not (np.array_equal(np.asarray(k), np.asarray(want_k)) and np.array_equal(np.asarray(v), np.asarray(want_v))):
            return False
    return True


class _progress:
    """A rich progress bar when asked for, else nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._bar = None
        if enabled:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.start()
            self._task = self._bar.add_task("demo workload", total=total)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def demo_cache(page_size: int = 16, max_total_tokens: int = 8192) -> KVCache:
    """The cache the demo builds, for notebooks and tests."""
    config = CacheConfig(page_size=page_size, max_total_tokens=max_total_tokens, max_running_requests=BATCH * 2,
                         context_length=1024)
    return build_kv_cache(ModelSpec.preset(DEMO_MODEL), config)
