"""Shared machinery of the pool kernels: backend dispatch, contiguous runs, DMA issue loops.

Every kernel in this package moves bytes between HBM buffers with manual DMAs (refs in
``pl.ANY`` memory space, ``pltpu.make_async_copy``) and never looks at the values, so it is
dtype-agnostic. The copies are described by a list of element pairs ``(src id, dst id)``
that the jnp wrapper groups into *runs*: maximal stretches where both ids grow by one and
no boundary (e.g. a page edge) is crossed. One run is one DMA (per layer), so the DMA count
grows with the runs, not with the elements.

Interpreter subset (both CPU interpreters run these kernels): no ref reshape/bitcast inside
kernels, every started DMA is waited exactly once with a descriptor of the same size, no
read of an aliased input after a write to it within the same call except through explicit
waits. Compiled TPU code and the TPU interpreter (``interpret=pltpu.InterpretParams(...)``)
issue one dynamic-length DMA per run. The HLO interpreter (``interpret=True``) cannot run
dynamic-length DMAs, so there a run moves element by element with static one-element DMAs:
same results, more (simulated) copies; it is a test path, never a production one. (A split
into power-of-two pieces would keep the DMA count per run logarithmic but doubles the HLO
interpreter's compile time, which the CPU test budget cares about more.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

#: ``None``/``False``: compiled Pallas on TPU, the jnp reference elsewhere (decided at lowering).
#: ``True``: the HLO interpreter. ``pltpu.InterpretParams(...)``: the TPU interpreter.
Interpret = bool | pltpu.InterpretParams | None

#: DMAs (runs) kept in flight before the kernel waits for them; bounded because each
#: outstanding DMA holds descriptor state and the per-run bookkeeping lives in scalar memory.
RUNS_IN_FLIGHT = 64

# A DMA descriptor factory: (offset within the run, size) -> descriptor.
DescriptorFn = Callable[[Any, Any], Any]


def check_interpret(interpret: Interpret) -> None:
    """Reject ``interpret`` values other than None, a bool or ``pltpu.InterpretParams``."""
    if interpret is None or isinstance(interpret, (bool, pltpu.InterpretParams)):
        return
    raise TypeError(f"interpret must be None, a bool or pltpu.InterpretParams, got {type(interpret).__name__}")


def uses_dynamic_dma(interpret: Interpret) -> bool:
    """Whether the kernel may issue dynamic-length DMAs (everywhere but the HLO interpreter)."""
    return interpret is not True


def traced_once(fn: Callable[..., Any], **static: Any) -> Callable[..., Any]:
    """``fn(*arrays, **static)`` as a jitted function made once per ``(fn, static)`` (module-level
    ``fn``, hashable ``static`` values): inside a trace, calls with the same shapes reuse one
    traced body, so a Pallas kernel is traced once per shape, not again at every layer of every
    program that calls it. For read-only kernels (attention): a kernel that aliases its inputs
    to its outputs is called directly, so the caller's donation reaches it."""
    return _traced_once(fn, tuple(sorted(static.items())))


@functools.lru_cache(maxsize=256)
def _traced_once(fn: Callable[..., Any], static: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    kwargs = dict(static)

    def bound(*args: Any) -> Any:
        return fn(*args, **kwargs)

    return jax.jit(bound)


def dispatch(
    kernel: Callable[..., Any],
    reference: Callable[..., Any],
    *args: Any,
    interpret: Interpret,
) -> Any:
    """Run ``kernel(*args, interpret=...)`` or ``reference(*args)``.

    With ``interpret`` unset the choice is made when lowering for a platform
    (``lax.platform_dependent``): a TPU lowering gets the compiled kernel, even when it is
    an ahead-of-time compile from a CPU host; every other platform gets the reference.
    """
    check_interpret(interpret)
    if interpret is None or interpret is False:
        return jax.lax.platform_dependent(
            *args,
            tpu=lambda *a: kernel(*a, interpret=False),
            default=reference,
        )
    return kernel(*args, interpret=interpret)


def contiguous_runs(
    src: jax.Array,
    dst: jax.Array,
    *,
    src_group: int | None = None,
    dst_group: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Group element copies ``src[i] -> dst[i]`` into runs that can move as one DMA each.

    ``src``, ``dst``: int32 ``[n]``. ``dst[i] < 0`` marks a dropped element; it always forms a
    run of its own (the kernels skip such runs). A new run starts at ``i`` unless
    ``src[i] == src[i-1] + 1`` and ``dst[i] == dst[i-1] + 1`` and neither id starts a new
    group (``id % group == 0``; a group is e.g. the slots of one page).

    Returns ``(starts, num_runs)``: ``starts`` int32 ``[n + 1]`` where run ``r`` covers elements
    ``[starts[r], starts[r + 1])`` for ``r < num_runs`` and ``starts[num_runs:] == n``;
    ``num_runs`` int32 ``[1]``. Fixed shapes, so one trace serves every id pattern.
    """
    n = src.shape[0]
    if n == 0:
        return jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
    prev_src = jnp.concatenate([src[:1] - 2, src[:-1]])
    prev_dst = jnp.concatenate([dst[:1] - 2, dst[:-1]])
    new = (src != prev_src + 1) | (dst != prev_dst + 1) | (dst < 0) | (prev_dst < 0)
    if src_group is not None:
        new |= src % src_group == 0
    if dst_group is not None:
        new |= dst % dst_group == 0
    new = new.at[0].set(True)
    (starts,) = jnp.nonzero(new, size=n + 1, fill_value=n)
    num_runs = jnp.sum(new, dtype=jnp.int32).reshape(1)
    return starts.astype(jnp.int32), num_runs


def copy_run(make: DescriptorFn, length: Any, *, dynamic: bool, action: str) -> None:
    """Start (``action="start"``) or wait for (``"wait"``) the DMAs of one run of ``length`` elements.

    ``make(offset, size)`` builds the descriptor of elements ``[offset, offset + size)`` of the
    run. Dynamic mode (TPU, TPU interpreter): one descriptor for the whole run. Static mode
    (HLO interpreter only, a test path): one single-element descriptor per element. Start and
    wait walk the same descriptors, so every started DMA is waited once with its own size.
    """
    if dynamic:
        getattr(make(0, length), action)()
        return

    @pl.loop(0, length)
    def _(offset: Any) -> None:
        getattr(make(offset, 1), action)()


def for_each_run(
    num_runs: Any,
    issue: Callable[[Any, str], None],
    *,
    in_flight: int = RUNS_IN_FLIGHT,
) -> None:
    """Call ``issue(r, "start")`` for a block of runs, then ``issue(r, "wait")`` for the same block.

    At most ``in_flight`` runs are outstanding; when this returns, every DMA it started has
    completed.
    """
    # lax.div, not //: floor division of signed ints lowers through sign(), which needs a TPU kind.
    num_blocks = jax.lax.div(num_runs + (in_flight - 1), in_flight)

    @pl.loop(0, num_blocks)
    def _(block: Any) -> None:
        lo = block * in_flight
        hi = jnp.minimum(lo + in_flight, num_runs)

        @pl.loop(lo, hi)
        def _(r: Any) -> None:
            issue(r, "start")

        @pl.loop(lo, hi)
        def _(r: Any) -> None:
            issue(r, "wait")


def out_like(x: Any, shape: Sequence[int] | None = None) -> jax.ShapeDtypeStruct:
    """Output type of ``x``'s dtype (and shape unless given) that varies over the same manual
    mesh axes as ``x``, so the kernels can run inside ``jax.shard_map`` with ``check_vma``."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return jax.ShapeDtypeStruct(tuple(x.shape if shape is None else shape), x.dtype, manual_axis_type=manual)


def any_memory() -> pl.BlockSpec:
    """A raw ref left where it lives (HBM on TPU): the kernel moves it by DMA itself."""
    return pl.BlockSpec(memory_space=pl.ANY)


def compiler_params() -> pltpu.CompilerParams:
    """One sequential grid step; the kernels pipeline their own DMAs."""
    return pltpu.CompilerParams(dimension_semantics=("arbitrary",))


def dma_call(
    kernel: Callable[..., None],
    scalars: Sequence[jax.Array],
    inputs: Sequence[jax.Array],
    *,
    out_shape: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
    bytes_accessed: int,
    interpret: Interpret,
    name: str,
    aliases: Mapping[int, int] | None = None,
    scratch_shapes: Sequence[Any] = (),
) -> Any:
    """Run ``kernel(*scalar refs, *input refs, *output refs, *scratch refs, sem)``: the call shape of
    every kernel in this package, one sequential grid step (``compiler_params``).

    ``scalars``: int32 arrays prefetched into SMEM (the run tables), in order. ``inputs`` and the
    outputs stay where they live (``any_memory``): the kernel moves them by DMA itself.
    ``out_shape``: one output type, or a sequence of them (then the call returns a list).
    ``aliases``: ``{input index: output index}``, indices within ``inputs`` and the outputs: that
    output is that input updated in place (donate it under ``jit``). ``scratch_shapes``: VMEM
    scratch, before the one DMA semaphore (the last ref) that the kernel's DMAs signal.
    ``bytes_accessed``: the HBM bytes read and written, for XLA's cost model (no flops).
    """
    outs: Any
    out_specs: Any
    if isinstance(out_shape, jax.ShapeDtypeStruct):
        outs, out_specs = out_shape, any_memory()
    else:
        outs, out_specs = list(out_shape), [any_memory()] * len(out_shape)
    num_scalars = len(scalars)
    return pl.pallas_call(
        kernel,
        out_shape=outs,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalars,
            grid=(1,),
            in_specs=[any_memory()] * len(inputs),
            out_specs=out_specs,
            scratch_shapes=[*scratch_shapes, pltpu.SemaphoreType.DMA((1,))],
        ),
        input_output_aliases={num_scalars + i: o for i, o in (aliases or {}).items()},
        compiler_params=compiler_params(),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=bytes_accessed),
        interpret=interpret,
        name=name,
    )(*scalars, *inputs)


def check_array(name: str, x: Any, shape: Sequence[int | None], dtype: Any = None, *, what: str) -> None:
    """Trace-time check of an argument's rank, shape (``None`` = any size) and dtype.

    Raises ``ValueError`` (shape) or ``TypeError`` (dtype) naming the argument, the expected
    shape and what its axes mean (``what``).
    """
    got = tuple(getattr(x, "shape", ()))
    if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got, strict=True)):
        want = "[" + ", ".join("?" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name} has shape {list(got)}; expected {want} ({what})")
    if dtype is not None and jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"{name} has dtype {jnp.dtype(x.dtype)}; expected {jnp.dtype(dtype)} ({what})")


def check_layers(name: str, layers: Sequence[Any], rank: int, what: str) -> tuple[tuple[int, ...], Any]:
    """Check a non-empty tuple of arrays sharing one shape (of ``rank``) and dtype; return them."""
    if not isinstance(layers, (tuple, list)) or not layers:
        raise TypeError(f"{name} must be a non-empty tuple of arrays ({what}), got {type(layers).__name__}")
    shape, dtype = tuple(layers[0].shape), jnp.dtype(layers[0].dtype)
    if len(shape) != rank:
        raise ValueError(f"{name}[0] has shape {list(shape)}; expected rank {rank} ({what})")
    for i, layer in enumerate(layers):
        if tuple(layer.shape) != shape or jnp.dtype(layer.dtype) != dtype:
            raise ValueError(
                f"{name}[{i}] is {jnp.dtype(layer.dtype)}{list(layer.shape)}; expected "
                f"{dtype}{list(shape)} like {name}[0] (all layers share one shape and dtype)"
            )
    return shape, dtype


def as_ids(name: str, ids: Any) -> jax.Array:
    """``ids`` as int32 ``[n]``; raises naming the argument if not a 1-D integer array."""
    ids = jnp.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"{name} has shape {list(ids.shape)}; expected [n] (one id per element)")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {ids.dtype}; expected integer ids")
    return ids.astype(jnp.int32)
