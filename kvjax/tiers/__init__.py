"""The host-memory tier (SGLang's HiCache L2) and the storage tier (L3), host side: host pools,
their slot allocator, sizing, the copy-engine protocol (with its simulated test double), the
agreed copy engine of several processes and the storage tier's store.

Importing this package imports neither jax nor the Pallas kernels. The device side, the page
transfers between a device pool and its host pool, is ``kvjax.transfers``.
"""

from kvjax.plan.host_sizing import check_host_memory, host_pool_tokens
from kvjax.tiers.copy_engine import CopyEngine, CopyError, TransferStatus
from kvjax.tiers.host_allocator import HostSlotAllocator
from kvjax.tiers.host_layout import HOST_LAYOUTS, HostLayout
from kvjax.tiers.host_pool import HostKVPool
from kvjax.tiers.simulated_copy import SimulatedCopyEngine

__all__ = [
    "HOST_LAYOUTS",
    "CopyEngine",
    "CopyError",
    "HostKVPool",
    "HostLayout",
    "HostSlotAllocator",
    "SimulatedCopyEngine",
    "TransferStatus",
    "check_host_memory",
    "host_pool_tokens",
]
