"""The host-memory tier (SGLang's HiCache L2): host pools, their slot allocator, sizing, and the
asynchronous page transfers between a device pool and its host pool.

Importing this package imports neither jax nor the Pallas kernels: the allocator, the sizing
rule, the host pool's numpy storage and the copy-engine protocol (with its simulated test
double) are host-side; ``kvjax.tiers.transfer`` (the device engine) and
``kvjax.tiers.device_pages`` import jax when they are imported.
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
