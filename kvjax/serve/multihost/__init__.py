"""Serving over several processes: ``front`` (``MultiProcessFront``, the serving loop of one
process), ``request_broadcast`` (``StepMessage``, process 0's new requests with their arrival
step), ``mesh`` (``group_tp_mesh`` and ``group_dp_mesh``, the serving meshes over every process)
and ``launcher`` (``python -m kvjax launch``, N local processes). The channel, the group and the
agreement they use are ``kvjax.multihost``'s. Import the modules directly.
"""
