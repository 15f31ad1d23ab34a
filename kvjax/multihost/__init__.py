"""Several processes (``jax.distributed``), the core of it: the channel every process exchanges
bytes over, the group it joins and the agreement that keeps every process's decisions equal. Every
process runs the same scheduler over its own copy of the tree, allocator and request table, on one
mesh over all processes' devices, and no copy ever diverges.

One concept per module (import them directly; this package imports nothing on its own, so the
scheduler can use the agreement without importing the rest):

* ``process_group``: ``initialize(ProcessFlags)`` joins the group; ``ProcessGroup``;
* ``socket_channel``: ``SocketChannel``, the serving loop's bounded byte exchanges over direct
  connections to process 0; ``channel``: the ``Channel`` protocol, ``ProcessChannel`` (the same
  through the coordination service's key-value store) and ``LoopbackChannel`` (one process);
* ``agreement``: ``Agreement`` (MIN over processes; the host tier's agreed transfer completions
  are ``kvjax.tiers.agreed_copy_engine``, the storage tier's page counts ``kvjax.radix.storage_link``);
* ``digest``: per-step state digests and their comparison;
* ``wire``: the typed, versioned messages (strict JSON) that are all that crosses a process
  boundary; ``cluster_secret``: the run's shared secret (``KVJAX_CLUSTER_SECRET``);
  ``handshake``: the socket rendezvous's challenge-response; ``frame_auth``: every frame's HMAC;
  ``socket_io``: bounded socket reads and writes;
* ``errors``: the group's errors.

The serving side lives with the serving loop (``kvjax.serve.multihost``: the front, the request
broadcast, the meshes over every process, the launcher), the flags with the command line
(``kvjax.cli.multihost_flags``).
"""
