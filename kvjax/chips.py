"""TPU chip presets for capacity planning: HBM per chip, from Google Cloud's public TPU pages.

``python -m kvjax plan --tpu v5e --chips 8`` plans one chip of a v5e-8 slice: the KV budget is the
chip's HBM times ``mem_fraction_static`` (SGLang's default 0.9), minus that chip's share of the
weights when ``--weights-bytes`` is given. kvjax does not estimate weights itself: a parameter count
from ``config.json`` misses quantization, tied embeddings and expert layouts, so the command line
asks for the checkpoint's size instead and says when it was not given.

Units: bytes (HBM is quoted in GiB by Google: 16 GiB on v5e, 32 GiB on v4 and v6e, 95 GiB on v5p).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvjax.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class TpuChip:
    """One TPU generation: its name as Cloud TPU writes it and its HBM per chip in bytes."""

    name: str
    hbm_bytes: int

    def slice_name(self, chips: int) -> str:
        """``"v5e-8"``: the generation and the chip count, as the slice would be named."""
        return f"{self.name}-{chips}"


TPU_CHIPS: dict[str, TpuChip] = {
    "v4": TpuChip("v4", 32 * GIB),
    "v5e": TpuChip("v5e", 16 * GIB),
    "v5p": TpuChip("v5p", 95 * GIB),
    "v6e": TpuChip("v6e", 32 * GIB),
}


def tpu_chip(name: str) -> TpuChip:
    """The preset called ``name`` (``"v5e"``; ``"v5litepod"`` is accepted for v5e)."""
    key = {"v5litepod": "v5e", "v5lite": "v5e"}.get(name.lower(), name.lower())
    if key not in TPU_CHIPS:
        raise ConfigError("tpu", name, f"use one of {sorted(TPU_CHIPS)}")
    return TPU_CHIPS[key]


def weights_per_chip(weights_bytes: int, model_parallel: int) -> int:
    """One chip's share of the weights when they are split over ``model_parallel`` chips
    (tensor x pipeline parallel), rounded up: replicas for data parallelism each hold a full copy."""
    if weights_bytes < 0:
        raise ConfigError("weights_bytes", weights_bytes, "give the checkpoint's size in bytes (>= 0)")
    if model_parallel < 1:
        raise ConfigError("model_parallel", model_parallel, "must be >= 1")
    return -(-weights_bytes // model_parallel)
