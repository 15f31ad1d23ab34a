"""Checking that a kernel updates donated buffers in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from pallas_kernels.testing import jit_interpreted


def run_donated(fn: Callable[..., Any], buffers: Any, *args: Any, interpret: Any) -> Any:
    """``fn(buffers, *args)`` jitted under ``interpret`` with ``buffers`` (an array or a tuple
    of them) donated; asserts that the call consumed them and returned its results in the very
    same device buffers (no copy), and returns the results."""
    leaves = jax.tree.leaves(buffers)
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
    out = jit_interpreted(fn, interpret=interpret, donate_argnums=0)(buffers, *args)
    assert all(x.is_deleted() for x in leaves), "a donated buffer is still alive"
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(out)] == pointers, "the result was copied"
    return out
