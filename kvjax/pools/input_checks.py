"""`check_float_input`: what a pool's write (and a query) accepts as activations.

A float of another width is cast to the pool's dtype (bfloat16 or float16 into a float32 pool and
back); an integer array is never cast: written as K/V it would be token or slot ids, a caller's bug
that would otherwise run and give a wrong answer silently.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["check_float_input"]


def check_float_input(name: str, x: Any, pool_dtype: str = "dtype") -> None:
    """Refuse K/V (or a query) that is not floating point: a float of another width is cast to the
    pool's dtype (bfloat16 or float16 into a float32 pool and back are fine), but integer values
    written as KV are a caller's bug (token ids, slot ids), never silently cast.

    Raises ``TypeError`` naming ``name``, its dtype and the pool's.
    """
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{name} has dtype {dtype}; K/V and queries must be floating point (bfloat16, float16, float32 "
            f"are cast to the pool's {pool_dtype}): an integer array here is not activations"
        )
