"""How many host slots the host tier gets (SGLang's ``HostKVCache.__init__`` sizing), jax-free.

``hicache_size`` (GB) > 0: ``int(hicache_size * 1e9 // bytes_per_token)`` tokens; otherwise
``int(device_tokens * hicache_ratio)``. Then ``(tokens // page_size + 1) * page_size``: rounded
down to pages plus one page (no slot is reserved on the host). 64 device tokens at ratio 2 give
129 slots at page 1 and 132 at page 4. ``kv_host_share``: the KV's part of ``hicache_size`` when
the recurrent-state checkpoints have a host pool beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.errors import ConfigError

if TYPE_CHECKING:
    from kvjax.plan.records import Sizes

# SGLang keeps this much host RAM free for everything else when it checks the host pool's size.
HOST_MEMORY_RESERVE_BYTES = 10 * (1 << 30)


def host_pool_tokens(
    device_tokens: int, page_size: int, *, hicache_ratio: float, hicache_size_gb: float = 0, bytes_per_token: int = 0
) -> int:
    """Host slots for a device pool of ``device_tokens`` allocatable tokens (see module docstring).

    Raises ConfigError for a non-positive page size, a negative device size, or a
    ``hicache_size`` without ``bytes_per_token``.
    """
    if page_size < 1:
        raise ConfigError("page_size", page_size, "use an integer >= 1")
    if device_tokens < 0:
        raise ConfigError("device_tokens", device_tokens, "use a size >= 0")
    if hicache_size_gb > 0:
        if bytes_per_token <= 0:
            raise ConfigError("bytes_per_token", bytes_per_token, "hicache_size needs the bytes one token costs")
        tokens = int(hicache_size_gb * 1e9 // bytes_per_token)
    else:
        tokens = int(device_tokens * hicache_ratio)
    return (tokens // page_size + 1) * page_size


def check_host_memory(host_bytes: int, available_bytes: int, reserve_bytes: int = HOST_MEMORY_RESERVE_BYTES) -> None:
    """Refuse a host tier that does not fit the host's memory less the reserve (SGLang's check).

    Raises ConfigError naming both figures.
    """
    limit = available_bytes - reserve_bytes
    if host_bytes > limit:
        raise ConfigError(
            "hicache_ratio/hicache_size",
            f"{host_bytes} bytes",
            f"the host tier needs {host_bytes / 2**30:.2f} GiB but the host has {available_bytes / 2**30:.2f} GiB "
            f"available less a {reserve_bytes / 2**30:.0f} GiB reserve ({max(limit, 0) / 2**30:.2f} GiB); "
            "lower hicache_ratio or hicache_size",
        )


def validate_retraction_host_capacity(host_tokens: int, context_length: int, page_size: int) -> None:
    """The ``host_pool`` retraction backup needs room for one retracted request of the longest
    context (its own pages: ``ceil(context / page) * page`` tokens). kvjax's reading of SGLang's
    ``validate_retraction_host_capacity``; raises ConfigError with both figures."""
    need = -(-context_length // page_size) * page_size
    if host_tokens < need:
        raise ConfigError(
            "hicache_ratio/hicache_size",
            f"{host_tokens} host tokens",
            f"the host_pool retraction backup needs room for one request of context_length {context_length} "
            f"({need} tokens at page {page_size}); raise hicache_ratio or hicache_size, or use 'cpu_tensor'",
        )


def kv_host_share(sizes: Sizes) -> float:
    """The KV's share of ``hicache_size`` when recurrent-state checkpoints get a host pool beside it
    (SGLang's ``_split_hicache_size``: the host bytes split over the device pools in proportion to
    their bytes; the state pool takes the rest, ``plan/kinds/recurrent.py``); 1 without state."""
    state = (sizes.max_mamba_cache_size or 0) * sizes.mamba_state_bytes_per_req
    kv = sizes.max_total_tokens * sizes.bytes_per_token
    return kv / (kv + state) if state and kv else 1.0
