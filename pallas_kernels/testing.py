"""Helpers for testing the pool kernels on CPU: interpreters, tiny pools, race checks.

Imported by the kernel tests (and usable by other code's tests); needs pytest only for the
``*_params`` helpers, which import it lazily.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Private module: the only place jax 0.10.2 exposes the TPU interpreter's race flag.
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

#: The HLO interpreter (fast; no race or bounds checks, clamps out-of-range indices).
HLO = True
#: The TPU interpreter with race detection. ``vector_clock_size`` > 2 is needed to see two DMAs
#: racing on one destination (the default leaves a single virtual DMA lane).
TPU = pltpu.InterpretParams(detect_races=True, vector_clock_size=64)

PAGE_SIZES = (1, 16, 64)


def interpreter_params() -> list[Any]:
    """``pytest.param`` of each CPU interpreter: the HLO one and the race-detecting TPU one."""
    import pytest

    return [pytest.param(HLO, id="hlo"), pytest.param(TPU, id="tpu")]


@dataclasses.dataclass(frozen=True)
class Heads:
    """A KV head configuration: ``kv_heads`` K and V heads of dims ``k_dim``/``v_dim``, padded to ``align``."""

    name: str
    kv_heads: int
    k_dim: int
    v_dim: int
    align: int = 1

    @property
    def combined(self) -> int:
        return 2 * self.kv_heads

    @property
    def padded(self) -> int:
        return -(-max(self.k_dim, self.v_dim) // self.align) * self.align


# MHA (as many KV heads as query heads; dims padded like TPU's 128 alignment, scaled down)
# and GQA/MQA-style few KV heads with K and V dims that differ.
HEADS = (
    Heads("mha4x8pad16", kv_heads=4, k_dim=8, v_dim=8, align=16),
    Heads("gqa1xk8v4", kv_heads=1, k_dim=8, v_dim=4),
)


def heads_params() -> list[Any]:
    """``pytest.param`` of each head configuration in ``HEADS``."""
    import pytest

    return [pytest.param(h, id=h.name) for h in HEADS]


def shape_params() -> list[Any]:
    """``pytest.param((page_size, heads))``: every page size with the GQA heads (K/V dims differ),
    and the MHA heads (padded) at page size 16. The kernels' structure depends on the page size,
    the heads only change the row shape, so this covers both without the full product."""
    import pytest

    mha, gqa = HEADS
    cases = [(ps, gqa) for ps in PAGE_SIZES] + [(16, mha)]
    return [pytest.param(c, id=f"page{c[0]}-{c[1].name}") for c in cases]


def num_pages_for(page_size: int) -> int:
    """Allocatable pages for a tiny pool: enough slots for the patterns, at most ~16 KiB."""
    return max(2, 24 // page_size)


def random_pool(rng: np.random.Generator, num_pages: int, page_size: int, combined: int, dim: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal((num_pages + 1, page_size, combined, dim)), jnp.float32)


def pack_kv(k: np.ndarray, v: np.ndarray, padded: int) -> np.ndarray:
    """``[n, H, dk]``, ``[n, H, dv]`` -> interleaved, zero-padded ``[n, 2H, padded]`` (the pool layout)."""
    n, heads, _ = k.shape
    out = np.zeros((n, 2 * heads, padded), np.float32)
    out[:, 0::2, : k.shape[2]] = k
    out[:, 1::2, : v.shape[2]] = v
    return out


def slot_pattern(rng: np.random.Generator, num_pages: int, page_size: int) -> np.ndarray:
    """Slot ids like a real batch: a prefill run crossing a page edge, scattered decode
    tokens, and padding (-1, past the end, the trash page) in between; live slots unique."""
    num_slots = (num_pages + 1) * page_size
    live = np.arange(page_size, num_slots)
    start = page_size // 2
    run = live[start : start + page_size + 3]
    rest = np.setdiff1d(live, run)
    decode = rng.choice(rest, size=min(5, rest.size), replace=False)
    pad = np.array([-1, num_slots + 7, 0, page_size - 1])
    return np.concatenate([decode[:2], run, pad[:2], decode[2:], pad[2:]]).astype(np.int32)


def assert_no_race() -> None:
    races = tpu_interpreter.races
    assert races is None or not races.races_found, "the TPU interpreter reported a race"


def race_found() -> bool:
    races = tpu_interpreter.races
    return races is not None and races.races_found


def assert_same(got: object, want: object) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


#: XLA:CPU options for interpreted kernels in tests: the interpreters emit large programs whose
#: optimisation costs more compile time than the tiny runs ever win back (~25% measured).
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0}


def jit_interpreted(
    fn: Callable[..., Any], *, interpret: Any, donate_argnums: int | tuple[int, ...] = ()
) -> Callable[..., Any]:
    """``jax.jit`` of ``fn(..., interpret=interpret)`` with the fast CPU compile options."""

    return jax.jit(
        functools.partial(fn, interpret=interpret),
        donate_argnums=donate_argnums,
        compiler_options=FAST_CPU_COMPILE if jax.default_backend() == "cpu" else None,
    )
