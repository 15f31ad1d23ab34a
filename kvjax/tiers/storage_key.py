"""`StorageKey`: everything that determines the bytes of a stored KV page, and its digest.

A page of the storage tier is only meaningful to a reader that would have computed the same
bytes: the same weights and config (``model``, a fingerprint: ``kvjax.serve.model_fingerprint``),
the same KV dtype and quantisation scales, the same page layout and shape (page size, KV heads
per page, padded head dim, layers), the same tensor-parallel rank and size, the same layers of the
same pipeline stage, and the same user namespace (SGLang's ``extra_key`` at the store level: a
cache salt or tenant), written in the same entry format (``version``). All of it is one record;
its :attr:`~StorageKey.digest` (blake2b, 128 bits, over the record's canonical JSON) names the
folder of the store every page of that key lives under, and is repeated in each entry's header
(``kvjax.tiers.storage_entry``). A store written under any other key is therefore never read: its
pages live under another folder, and an entry copied across folders fails the header check.

The record is plain and JSON-able (:meth:`~StorageKey.to_dict`); the store writes it next to the
pages (``<digest>/key.json``) so a person can tell which model a folder holds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from typing import Any

import numpy as np

from kvjax.errors import ConfigError

#: The entry format and page layout written by this version of kvjax; bump it whenever either,
#: or the model code's numerics that produce KV, change, so old stores stop being read.
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class StorageKey:
    """What determines the bytes of a stored page (see the module docstring).

    Args:
        model: the model fingerprint (weights and config; ``LoadedModel.fingerprint``), non-empty.
        page_shape: one stored page, ``(layers, page_size, C, D)`` in the host ``page_first``
            layout (``C`` = 2 * KV heads for MHA, K and V interleaved; 1 for an MLA latent).
        store_dtype: the numpy dtype the page's elements are stored as (the bit pattern,
            e.g. ``uint16`` for bfloat16).
        kv_dtype: the logical KV dtype (``bfloat16``, ``float8_e4m3fn``...).
        kv_scales: the per-layer K then V scales of a quantised (fp8) pool; ``()`` when unscaled.
        layout: the pool kind and the page's axis order, e.g. ``"mha/page_first"``.
        tp_rank, tp_size: whose KV heads a page holds, and the TP size. A pool sharded over
            KV heads stores each rank's heads as its own entry under its rank's key
            (:meth:`for_shard`; ``kvjax.tiers.storage``), so a store written at one TP size is
            never read at another; a page that holds every head (one rank, or MLA's latent,
            replicated over the ranks) is keyed with rank 0 (the process index across processes).
        layers: the global ids of the layers in a page (default ``0 .. layers-1``).
        namespace: the user's namespace (a cache salt or tenant); ``""`` for none.
        version: the entry format (`FORMAT_VERSION`).

    Invariants (ConfigError otherwise, naming the field): ``model`` non-empty, a positive
    ``page_shape`` of at least two axes, ``tp_rank >= 0``, ``tp_size >= 1``, one layer id per layer.
    """

    model: str
    page_shape: tuple[int, ...]
    store_dtype: str
    kv_dtype: str
    kv_scales: tuple[float, ...] = ()
    layout: str = "mha/page_first"
    tp_rank: int = 0
    tp_size: int = 1
    layers: tuple[int, ...] | None = None
    namespace: str = ""
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(
                "model fingerprint",
                self.model,
                "give the fingerprint of the weights (LoadedModel.fingerprint, or "
                "kvjax.serve.model_fingerprint.random_weights_fingerprint for random weights)",
            )
        shape = tuple(int(d) for d in self.page_shape)
        if len(shape) < 2 or min(shape) < 1:
            raise ConfigError("page_shape", tuple(self.page_shape), "give the positive (layers, page_size, ...) shape")
        object.__setattr__(self, "page_shape", shape)
        object.__setattr__(self, "store_dtype", np.dtype(self.store_dtype).name)
        object.__setattr__(self, "kv_scales", tuple(float(s) for s in self.kv_scales))
        if self.tp_rank < 0 or self.tp_size < 1:
            raise ConfigError("tp_rank/tp_size", (self.tp_rank, self.tp_size), "need tp_rank >= 0 and tp_size >= 1")
        layers = tuple(range(shape[0])) if self.layers is None else tuple(int(i) for i in self.layers)
        if len(layers) != shape[0]:
            raise ConfigError("layers", self.layers, f"give one layer id per layer of the page ({shape[0]})")
        object.__setattr__(self, "layers", layers)

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.page_shape[1]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's data (without the entry header)."""
        return math.prod(self.page_shape) * np.dtype(self.store_dtype).itemsize

    def for_shard(self, tp_rank: int, heads: int) -> StorageKey:
        """The key of one rank's entry of a page split over KV heads: this key with ``tp_rank``
        and ``heads`` on the page's head axis (``page_shape[2]``). ConfigError for a page shape
        without a head axis or a head count that is not positive."""
        if len(self.page_shape) < 4 or heads < 1:
            raise ConfigError(
                "heads", heads, f"a shard needs >= 1 head of a (layers, page_size, C, D) page, not {self.page_shape}"
            )
        shape = (*self.page_shape[:2], int(heads), *self.page_shape[3:])
        return dataclasses.replace(self, tp_rank=int(tp_rank), page_shape=shape)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON values (tuples as lists)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @functools.cached_property
    def digest(self) -> str:
        """32 hex digits: blake2b-128 of the canonical JSON of :meth:`to_dict`. Equal keys give
        equal digests; any field that differs gives another digest."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
