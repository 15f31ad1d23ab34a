"""The radix prefix cache: one pure-Python tree core, components, and the familiar presets.

``RadixCache`` (full KV), ``MambaRadixCache`` (full KV + recurrent-state checkpoints),
``SWARadixCache`` (hybrid sliding window: FULL + SWA components) and ``ChunkCache`` /
``SWAChunkCache`` / ``PureSWAChunkCache`` (radix cache disabled) keep SGLang's method names;
``create_tree_cache(plan)`` builds one from a cache plan's typed ``TreeOptions``. Further kinds of state plug in as
components (``TreeComponent``; see ``component.py``). Importing this package imports neither
jax nor the Pallas kernels.
"""

from kvjax.page_hash import PageHasher
from kvjax.plan.tree_options import TreeOptions
from kvjax.radix.chunk_cache import ChunkCache
from kvjax.radix.component import ComponentSizes, FullKVComponent, TreeComponent
from kvjax.radix.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvjax.radix.eviction import EVICTION_POLICIES, EvictionPolicy, get_eviction_policy
from kvjax.radix.himamba_component import HiMambaComponent
from kvjax.radix.himamba_radix_cache import HiMambaRadixCache
from kvjax.radix.hiradix_cache import HiRadixCache
from kvjax.radix.hiswa_radix_cache import HiSWARadixCache
from kvjax.radix.host_component import HostTierComponent
from kvjax.radix.insert_result import InsertResult
from kvjax.radix.lock import LockError, LockReceipt
from kvjax.radix.mamba_component import MambaComponent, MambaMatch
from kvjax.radix.mamba_radix_cache import MambaEvictResult, MambaInsertResult, MambaRadixCache
from kvjax.radix.match import ComponentMatchResult, MatchResult
from kvjax.radix.node import TreeNode
from kvjax.radix.pure_swa_radix_cache import PureSWARadixCache
from kvjax.radix.radix_cache import RadixCache
from kvjax.radix.registry import create_tree_cache, tree_cache_kinds
from kvjax.radix.slot_component import NodeSlot, NodeSlotComponent
from kvjax.radix.stats import CacheStats
from kvjax.radix.storage_link import StorageOptions
from kvjax.radix.swa_chunk_cache import PureSWAChunkCache, SWAChunkCache
from kvjax.radix.swa_component import SWAComponent, SWAInsertPayload, SWALockPart
from kvjax.radix.swa_radix_cache import SWARadixCache
from kvjax.radix.tree import RadixTree, TreeInvariantError

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "ComponentMatchResult",
    "ComponentSizes",
    "ChunkCache",
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "FullKVComponent",
    "HiRadixCache",
    "HiMambaComponent",
    "HiMambaRadixCache",
    "HiSWARadixCache",
    "HostTierComponent",
    "InsertResult",
    "LockError",
    "LockReceipt",
    "MambaComponent",
    "MambaEvictResult",
    "MambaInsertResult",
    "MambaMatch",
    "MambaRadixCache",
    "MatchResult",
    "NodeSlot",
    "NodeSlotComponent",
    "PageHasher",
    "PureSWAChunkCache",
    "RadixCache",
    "RadixTree",
    "SWAChunkCache",
    "SWAComponent",
    "SWAInsertPayload",
    "SWALockPart",
    "PureSWARadixCache",
    "SWARadixCache",
    "TreeComponent",
    "TreeInvariantError",
    "TreeNode",
    "TreeOptions",
    "StorageOptions",
    "create_tree_cache",
    "tree_cache_kinds",
    "get_eviction_policy",
]
