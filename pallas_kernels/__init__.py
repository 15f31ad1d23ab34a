"""Pallas TPU kernels of the kvjax pools, each with a pure-jnp reference.

Every public wrapper runs the compiled Pallas kernel when lowered for TPU, the reference on
other platforms, and an interpreter when ``interpret=`` asks for one (``True``: the HLO
interpreter; ``pltpu.InterpretParams(...)``: the TPU interpreter). The kernels move bytes and
are dtype-agnostic. Page 0 / state slot 0 is the trash page / reserved slot: writes aimed at
it, or out of range, are dropped.

Sharded pools: a Mosaic kernel cannot be partitioned automatically, so for a pool sharded over
KV heads call the wrappers inside ``jax.shard_map`` (pool specs ``P(None, None, axis, None)``,
ids replicated); each device then moves its own heads' rows in place.

Modules: ``kv_write``, ``page_copy``, ``page_gather``, ``state_slots`` (one kernel family each),
``validate`` (host-side id checks), ``aot`` (deviceless TPU compiles, needs libtpu),
``testing`` (CPU interpreter helpers for tests).
"""

from pallas_kernels.kv_write import write_kv, write_kv_reference
from pallas_kernels.page_copy import copy_pages, copy_pages_reference, copy_slots, copy_slots_reference
from pallas_kernels.page_gather import (
    gather_pages,
    gather_pages_reference,
    gather_pages_to_host,
    scatter_pages,
    scatter_pages_from_host,
    scatter_pages_reference,
)
from pallas_kernels.state_slots import (
    copy_state_slots,
    copy_state_slots_reference,
    zero_slots,
    zero_slots_reference,
)

__all__ = [
    "copy_pages",
    "copy_pages_reference",
    "copy_slots",
    "copy_slots_reference",
    "copy_state_slots",
    "copy_state_slots_reference",
    "gather_pages",
    "gather_pages_reference",
    "gather_pages_to_host",
    "scatter_pages",
    "scatter_pages_from_host",
    "scatter_pages_reference",
    "write_kv",
    "write_kv_reference",
    "zero_slots",
    "zero_slots_reference",
]
