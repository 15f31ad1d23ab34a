"""`PoolPlan`: one buffer a plan asks the build to allocate (jax-free).

Pool-kind modules (``kvjax.pools.*_layout``) make these; the planner collects them; the build
dispatches each to its kind's ``create`` through ``kvjax.pools.registry``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PoolPlan:
    """One buffer the build will allocate: where it lives, its shape, dtype and total bytes.

    ``count`` arrays of ``shape`` (one per layer for KV pools); ``nbytes`` covers all of them,
    padding (the trash page or padding slot) included. Bytes are per device (per TP/PP rank).

    Attributes:
        name: unique within a plan (``"kv"``, ``"kv_full"``, ``"ssm_state"``, ``"req_to_token"``, ...).
        kind: the pool kind (``kvjax.plan.kinds.pool_kinds()``), whose builder
            ``kvjax.pools.registry`` looks up.
        memory: ``"device"`` or ``"host"``.
        built: False when the capability that would build it is not implemented yet.
        bytes_per_token: bytes one token costs in this pool, summed over its layers, per rank
            (the host pool of a pool sharded over KV heads: over every distinct head, as it is
            built; 0 for pools not sized in tokens: recurrent state, the request table).
        layer_ids: global ids of the model layers this pool serves (empty when not per layer).
        layout: the kind's layout record (shape rules and dims), or None.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    nbytes: int
    memory: str = "device"
    built: bool = True
    bytes_per_token: int = 0
    layer_ids: tuple[int, ...] = ()
    layout: Any = None

    @classmethod
    def paged(
        cls,
        name: str,
        kind: str,
        *,
        shape: tuple[int, ...],
        dtype: str,
        page_size: int,
        layer_ids: tuple[int, ...],
        bytes_per_token_per_layer: int,
        layout: Any,
        memory: str = "device",
        built: bool = True,
    ) -> PoolPlan:
        """The plan of a paged pool: one array of ``shape`` per layer of ``layer_ids``, axis 0 its
        pages (the trash page included) of ``page_size`` tokens; a token costs
        ``bytes_per_token_per_layer`` in each layer, padding included."""
        per_token = len(layer_ids) * bytes_per_token_per_layer
        return cls(
            name=name,
            kind=kind,
            shape=shape,
            dtype=dtype,
            count=len(layer_ids),
            nbytes=shape[0] * page_size * per_token,
            memory=memory,
            built=built,
            bytes_per_token=per_token,
            layer_ids=layer_ids,
            layout=layout,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: shape and layer ids as lists, the layout as a dict (or None)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["shape"] = list(self.shape)
        d["layer_ids"] = list(self.layer_ids)
        d["layout"] = None if self.layout is None else dataclasses.asdict(self.layout)
        return d
