"""What the tensor-parallel parity tests share: the mesh of ``tp`` CPU devices and the check that
a scheduler's pools and weights really are laid out over it."""

from __future__ import annotations

from typing import Any

import jax


def mesh_of(tp: int) -> jax.sharding.Mesh:
    """A ``"tp"`` mesh of the first ``tp`` CPU devices."""
    return jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])


def assert_sharded(sched: Any, tp: int) -> None:
    """The pools and the weights really are laid out over the tp devices."""
    assert sched.mesh is not None and sched.mesh.shape["tp"] == tp
    leaves = jax.tree_util.tree_leaves_with_path(sched.cache.pools)
    off = [jax.tree_util.keystr(p) for p, a in leaves if len(a.sharding.device_set) != tp]
    assert not off, f"pool arrays not on the mesh's {tp} devices: {off}"
    weights = jax.tree.leaves(sched.params)
    assert any(not a.sharding.is_fully_replicated for a in weights), "some weights should be split over tp"


def family_config(name: str, **overrides: Any) -> Any:
    """The Transformers config of a tiny parity family (the parity tests' own, ``tests/serve``):
    ``"llama"`` or ``"qwen3"`` (``test_parity_transformers``), ``"gemma3"`` or ``"deepseek_v2"``;
    ``overrides`` replace its fields."""
    from tests.serve.parity_harness import transformers
    from tests.serve.test_parity_deepseek_v2 import CONFIG as DEEPSEEK_V2
    from tests.serve.test_parity_gemma3 import CONFIG as GEMMA3
    from tests.serve.test_parity_transformers import COMMON, FAMILIES

    if name in FAMILIES:
        cls, extra = FAMILIES[name]
        return getattr(transformers, cls)(**{**COMMON, **overrides}, **extra)
    if name == "gemma3":
        return transformers.Gemma3TextConfig(**{**GEMMA3, **overrides})
    if name == "deepseek_v2":
        return transformers.DeepseekV2Config(**{**DEEPSEEK_V2, **overrides})
    raise ValueError(f"no tiny parity family {name!r}; use one of {sorted(FAMILIES)}, 'gemma3' or 'deepseek_v2'")


def family_checkpoint(name: str, tmp_path_factory: Any, *, label: str | None = None, **overrides: Any) -> Any:
    """``(hf, model)`` of ``family_config(name, **overrides)``: the random-weight Transformers model
    and kvjax's load of its checkpoint, saved under ``label`` (default ``name``)."""
    from tests.serve.parity_harness import tiny_checkpoint

    return tiny_checkpoint(family_config(name, **overrides), tmp_path_factory, label or name)


def serve_recurrent_over_tp(model: Any, max_new: int, tp: int) -> tuple[Any, dict[str, Any]]:
    """``parity_harness.serve_recurrent`` of a hybrid recurrent model over a ``"tp"`` mesh of
    ``tp`` devices, through a cache small enough (56 pool tokens, 4 running requests, 6 recurrent
    slots) that its rounds reuse prefixes, evict and retract; the pools and weights asserted
    sharded. Returns ``(scheduler, finished requests by name)``."""
    from tests.serve.parity_harness import serve_recurrent

    sched, done = serve_recurrent(
        model,
        max_new,
        mesh=mesh_of(tp),
        tp_size=tp,
        max_total_tokens=56,
        max_running_requests=4,
        max_mamba_cache_size=6,
    )
    assert_sharded(sched, tp)
    return sched, done
