"""The media KV events name (jax-free, no dependency): kvjax's tiers in process, SGLang's names on
the wire (``"GPU"`` is vLLM's ``MEDIUM_GPU`` too; kvjax's device pool on a TPU is reported so, the
name routers know for the device tier)."""

from __future__ import annotations

__all__ = ["WIRE_MEDIUM"]

#: kvjax's medium (``kvjax.radix.events``) -> the medium on the wire.
WIRE_MEDIUM = {"device": "GPU", "host": "CPU_TIER1", "storage": "CPU_TIER2"}
