"""The device side of the host and storage tiers: moving pages between device pools and host
memory, in place under donation.

``transfer`` (``PageTransferEngine``: the host tier's copy engine over one device pool; the page
gather/scatter kernels), ``swa_transfer`` (both sides of a sliding-window pair), ``device_pages``
(a paged pool's page arrays, for the pools whose class says ``HOST_COPYABLE``),
``transfer_engines`` (what an engine is made from, and the default one),
``retraction_backup`` (the ``cpu_tensor`` decode retraction backup's copies), ``draft_pools`` (the
draft model's host pool beside the target's) and ``storage_attach`` (the storage tier over the
host pool). The host side (host pools, their allocator, the copy-engine protocol, the storage
tier's store) is ``kvjax.tiers``. Importing a module here imports jax.
"""
