"""`KindRegistry`: one layer's registrations of the cache kinds, keyed by the kind's name.

A cache kind is registered once per layer that acts on cached state, each time with a record
of that layer's own (bottom to top, ``LAYERS``):

========== ======================================== =================================================
layer      record (where)                           what it says
========== ======================================== =================================================
plan       ``PlannerKind`` (``kvjax.plan.kinds``)    whether a model needs it, its pools and sizes, its
                                                    trees' names, its refusals
host       ``HostKind`` (``kvjax.radix.kinds``)      its trees' builders, allocator and request table
pools      ``PoolBuilders`` (``kvjax.pools.registry``) how its pools are built; the host tier's engine
attention  ``AttentionKind`` (``kvjax.attention.kinds``) what ``attend`` runs for a layer of its pools
serving    ``ServingKind`` (``kvjax.serve.kinds``)   its serving hooks (``ServingExtension``)
========== ======================================== =================================================

A layer looks a kind up by name (``registry[name]``), so no layer imports another's record and
the name is the only thing they share. The kinds are kept in one order, the order in which their
names were first registered in any layer (the built-in kinds first, ``names.BUILTIN_KINDS``);
every registry lists its entries in that order. A kind is complete when every layer has
registered it: ``registry[name]`` raises ``ConfigError`` naming the kind, the layer and how to
register it when that layer has not, and ``incomplete_kinds()`` lists what is missing in the
layers loaded so far.

Invariants: a name is registered at most once per layer; ``unregister_kind(name)`` removes it from
every layer (and from the order) at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from kvjax.errors import ConfigError

__all__ = ["LAYERS", "KindRegistry", "incomplete_kinds", "kind_names", "registries", "unregister_kind"]

LAYERS = ("plan", "host", "pools", "attention", "serving")
"""The layers a cache kind registers in, bottom to top."""

T = TypeVar("T")

_ORDER: dict[str, None] = {}  # every registered kind's name, in first-registration order
_REGISTRIES: dict[str, KindRegistry] = {}  # layer -> its registry (those imported so far)


class KindRegistry(Generic[T]):
    """The ``layer``'s record for each registered cache kind (``registry[name]``).

    ``how``: the function a kind calls to register in this layer (named in the error for a
    missing registration).
    """

    def __init__(self, layer: str, how: str) -> None:
        if layer not in LAYERS:
            raise ValueError(f"layer {layer!r} is not one of {LAYERS}")
        if layer in _REGISTRIES:
            raise ValueError(f"the {layer} layer has a kind registry already")
        self.layer = layer
        self.how = how
        self._entries: dict[str, T] = {}
        _REGISTRIES[layer] = self

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` as kind ``name``'s record of this layer; returns it.

        Raises ``ConfigError`` (nothing changed) when ``name`` is registered in this layer already.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError("cache kind", name, "a kind's name is a non-empty string")
        if name in self._entries:
            raise ConfigError(
                "cache kind",
                name,
                f"the name is registered in the {self.layer} layer; pick another than {self.names()}",
            )
        self._entries[name] = entry
        _ORDER.setdefault(name, None)
        return entry

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            if name in _ORDER:
                raise ConfigError(
                    "cache kind",
                    name,
                    f"the kind has no registration in the {self.layer} layer; register one with {self.how}",
                ) from None
            raise ConfigError("cache kind", name, f"use one of {kind_names()}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> T | None:
        """Kind ``name``'s record of this layer, or None."""
        return self._entries.get(name)

    def names(self) -> list[str]:
        """The kinds registered in this layer, in the kinds' order."""
        return [name for name in _ORDER if name in self._entries]

    def entries(self) -> tuple[T, ...]:
        """This layer's records, in the kinds' order."""
        return tuple(self._entries[name] for name in self.names())

    def __iter__(self) -> Iterator[T]:
        return iter(self.entries())

    def _drop(self, name: str) -> T | None:
        return self._entries.pop(name, None)


def kind_names() -> list[str]:
    """Every kind registered in any layer, in the kinds' order."""
    return list(_ORDER)


def registries() -> dict[str, KindRegistry]:
    """The layers' registries loaded so far, bottom to top."""
    return {layer: _REGISTRIES[layer] for layer in LAYERS if layer in _REGISTRIES}


def incomplete_kinds() -> dict[str, list[str]]:
    """``{kind: [layers without its registration]}`` over the layers loaded so far (empty: every
    kind is complete in every loaded layer)."""
    missing = {name: [layer for layer, reg in registries().items() if name not in reg] for name in _ORDER}
    return {name: layers for name, layers in missing.items() if layers}


def unregister_kind(name: str) -> None:
    """Remove kind ``name`` from every layer and from the order (a kind registered by a test or a
    plugin being reloaded). ``ConfigError`` naming the kinds when ``name`` is not registered."""
    if name not in _ORDER:
        raise ConfigError("cache kind", name, f"use one of {kind_names()}")
    for registry in _REGISTRIES.values():
        registry._drop(name)
    del _ORDER[name]
