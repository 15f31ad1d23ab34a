"""Prefill/decode disaggregation: a request's prompt computed on a prefill server, its KV moved into
a decode server's pools through JAX's transfer server, decoded there (SGLang's
``--disaggregation-mode prefill|decode``).

* ``messages``: the typed messages between the two sides (strict JSON, nothing unpickled).
* ``link``: an authenticated, framed connection (the cluster secret's challenge-response, every
  frame sealed), every wait bounded.
* ``kv_transfer``: a request's cache as pieces (each pool kind's ``RequestKV``), offered and pulled
  through ``jax.experimental.transfer``.
* ``prefill``: the prefill server (bootstrap endpoint, snapshots of finished prompts).
* ``decode``: the decode server (its own radix tree: only what it lacks is pulled).
* ``router``: the mini load balancer pairing each request with one prefill and one decode server.
* ``serving``: the command line's runs (a prefill server built as ``generate`` builds its cache,
  ``generate``'s prompts through a decode server).
"""
