"""Multi-process serving (``jax.distributed``): every process runs the same scheduler over its own
copy of the tree, allocator and request table, on one mesh over all processes' devices, and no
copy ever diverges.

One concept per module (import them directly; this package imports nothing on its own, so the
scheduler can use the agreement without importing the rest):

* ``process_group``: ``initialize(ProcessFlags)`` joins the group; ``ProcessGroup``;
* ``socket_channel``: ``SocketChannel``, the serving loop's bounded byte exchanges over direct
  connections to process 0; ``channel``: the ``Channel`` protocol, ``ProcessChannel`` (the same
  through the coordination service's key-value store) and ``LoopbackChannel`` (one process);
* ``request_broadcast``: ``StepMessage``, process 0's new requests with their arrival step;
* ``front``: ``MultiProcessFront``, the serving loop of one process;
* ``agreement``: ``Agreement`` (MIN over processes) and ``agreed_copy_engine``, the host tier's
  agreed transfer completions (the storage tier's page counts: ``kvjax.radix.storage_link``);
* ``digest``: per-step state digests and their comparison;
* ``mesh``: ``group_tp_mesh`` and ``group_dp_mesh``, the serving meshes over every process;
* ``launcher``: ``python -m kvjax launch``, N local processes.
"""
