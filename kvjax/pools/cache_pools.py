"""`CachePools`: every device pool of one KV cache, by name, as one pytree to donate into a step."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax


@jax.tree_util.register_pytree_node_class
class CachePools:
    """The device state of a KV cache: any set of pools, each under its plan name.

    The names are the plan's: ``kv`` (``MHAKVPool``, or ``MLAKVPool`` for MLA models), ``swa``
    (``SWAKVPool`` of a sliding-window model), ``recurrent`` (``RecurrentStatePool``), ``index_k``
    (``DSAIndexerKeyPool``) and ``kv_draft`` (a speculative draft model's pool). Attribute and
    item access both work (``pools.kv``, ``pools["kv"]``).

    A pytree whose children are the pools in name order (the names are static metadata): pass
    the whole object to a jitted step with ``donate_argnums`` and return the updated one (made
    with :meth:`replace`); every pool is then updated in place. Immutable: ``replace`` returns a
    new object.
    """

    __slots__ = ("_origin", "_pools")

    def __init__(self, pools: Mapping[str, Any] | None = None, /, **named: Any) -> None:
        merged = dict(pools or {})
        overlap = merged.keys() & named.keys()
        if overlap:
            raise ValueError(f"CachePools: pools {sorted(overlap)} given twice")
        merged.update(named)
        if not merged:
            raise ValueError("CachePools needs at least one pool, e.g. CachePools(kv=MHAKVPool.create(...))")
        object.__setattr__(self, "_pools", dict(sorted(merged.items())))
        object.__setattr__(self, "_origin", None)

    # --- access -------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        pools = object.__getattribute__(self, "_pools")
        try:
            return pools[name]
        except KeyError:
            raise AttributeError(f"CachePools has no pool {name!r}; pools: {list(pools)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("CachePools is immutable: use pools.replace(name=new_pool)")

    def __getitem__(self, name: str) -> Any:
        try:
            return self._pools[name]
        except KeyError:
            raise KeyError(f"CachePools has no pool {name!r}; pools: {list(self._pools)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._pools

    def __iter__(self) -> Iterator[str]:
        return iter(self._pools)

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def names(self) -> tuple[str, ...]:
        """The pool names, sorted."""
        return tuple(self._pools)

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self._pools.items())

    def replace(self, **changes: Any) -> CachePools:
        """A copy with some pools replaced. Only existing names (``ValueError`` naming them otherwise)."""
        unknown = changes.keys() - self._pools.keys()
        if unknown:
            raise ValueError(f"CachePools.replace: no pools {sorted(unknown)}; pools: {list(self._pools)}")
        return CachePools({**self._pools, **changes})

    def nbytes(self) -> int:
        """Bytes of every device buffer."""
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(self))

    def __repr__(self) -> str:
        return f"CachePools({', '.join(f'{k}={type(v).__name__}' for k, v in self._pools.items())})"

    # --- pytree ---------------------------------------------------------------------------------

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[str, ...]]:
        return tuple(self._pools.values()), tuple(self._pools)

    @classmethod
    def tree_unflatten(cls, names: tuple[str, ...], children: Any) -> CachePools:
        obj = object.__new__(cls)
        object.__setattr__(obj, "_pools", dict(zip(names, children, strict=True)))
        object.__setattr__(obj, "_origin", names)
        return obj

    @property
    def origin(self) -> tuple[str, ...] | None:
        """The names tuple of the tree structure (``PyTreeDef``) this object was rebuilt from,
        the very object stored in it; None for pools built by the constructor or ``replace``.

        Every ``tree_flatten`` returns a fresh tuple, so an origin is shared only by objects
        rebuilt from one treedef (or treedefs JAX derived from it), such as every output of one
        compiled step: ``KVCache.set_pools`` checks the structure once per origin, keyed by
        identity.
        """
        return self._origin
