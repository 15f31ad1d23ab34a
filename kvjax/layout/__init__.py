"""Layouts: what a pool holds per token and how many bytes that is, and the `PoolPlan` record
the planner lists pools in (jax-free).

``mha`` (K/V heads), ``mla`` (the latent row and its rope part), ``recurrent`` (per-request
state tensors); ``storage`` names the storage dtypes and their sizes; ``alignment`` the TPU lane
padding. The planner (``kvjax.plan``) asks these of a model; the pools (``kvjax.pools``) are
built from the ``PoolPlan``s it returns. Nothing here imports jax.
"""
