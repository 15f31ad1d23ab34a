"""Settings of the TPU compile tests: no persistent compilation cache.

The suite-wide cache would be asked to store and reload executables compiled for deviceless
TPU topologies, which fails (there is no TPU client to load them into) and only adds warnings.
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_compilation_cache", False)
