"""The serving layer's kind registry: each cache kind's serving hooks (`ServingKind`).

``default_extensions(cache)`` makes the ``ServingExtension`` of each kind the cache's plan uses
(``kvjax.plan.kinds.planner_kinds_of``), in the kinds' order; the scheduler takes them unless it
is given its own. A kind without serving hooks (full attention, MLA, the request table) registers
an empty record. The built-in kinds are registered when this module is imported; their
extensions' modules load only when a cache needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvjax.kinds import names
from kvjax.kinds.registry import KindRegistry
from kvjax.plan.kinds import planner_kinds_of

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.serve.extension import ServingExtension

__all__ = ["SERVING_KINDS", "ServingKind", "default_extensions", "register_serving_kind", "retraction_parts"]


@dataclass(frozen=True)
class ServingKind:
    """A cache kind's serving hooks.

    Attributes:
        name: the cache kind's name.
        serving_extension: ``(cache) -> ServingExtension | None``, the kind's serving hooks for
            ``cache`` (None: none for this cache, e.g. a pipeline stage without the kind's pool).
        retraction_parts: ``(cache) -> parts | None``, what the ``cpu_tensor`` retraction backup
            copies of the kind's pools (``kvjax.transfers.retraction_backup.CopyPart`` s, or pool
            names copied at the request's slots, or ``RowPart`` s: rows the request holds, its
            recurrent state slot); ``None`` from it: the kind's state cannot be
            backed up in ``cache`` (retracted requests recompute). No hook: the kind has no pool
            of its own to copy.
    """

    name: str
    serving_extension: Callable[[KVCache], ServingExtension | None] | None = None
    retraction_parts: Callable[[KVCache], Sequence[Any] | None] | None = None


SERVING_KINDS: KindRegistry[ServingKind] = KindRegistry("serving", "kvjax.serve.kinds.register_serving_kind")


def register_serving_kind(kind: ServingKind) -> ServingKind:
    """Add ``kind``'s serving hooks; ``ConfigError`` (nothing changed) when its name is registered
    in this layer."""
    if not isinstance(kind, ServingKind):
        raise TypeError(f"register_serving_kind: expected a ServingKind, got {type(kind).__name__}")
    return SERVING_KINDS.register(kind.name, kind)


def default_extensions(cache: KVCache) -> list[ServingExtension]:
    """The serving hooks of the kinds ``cache``'s plan uses, in the kinds' order (built in: sliding
    window, recurrent state, host tier, retraction backup; none for full attention). A used kind
    with no serving registration raises ``ConfigError`` naming it."""
    extensions: list[ServingExtension] = []
    for kind in planner_kinds_of(cache.plan):
        make = SERVING_KINDS[kind.name].serving_extension
        extension = make(cache) if make is not None else None
        if extension is not None:
            extensions.append(extension)
    return extensions


def retraction_parts(cache: KVCache) -> list[Any] | None:
    """What the ``cpu_tensor`` retraction backup copies of ``cache``: every used kind's
    ``retraction_parts``, in the kinds' order; ``None`` when a kind's state cannot be backed up."""
    parts: list[Any] = []
    for kind in planner_kinds_of(cache.plan):
        make = SERVING_KINDS[kind.name].retraction_parts
        found = None if make is None else make(cache)
        if make is not None and found is None:
            return None
        parts.extend(found or ())
    return parts


def _kv_pool(cache: KVCache) -> tuple[str, ...]:
    """The attention pool ``"kv"``, copied at the request's slots (none of its own when another
    kind's pool holds these layers: a hybrid sliding-window pool's full side)."""
    return ("kv",) if "kv" in cache.pools else ()


def _swa_parts(cache: KVCache) -> Sequence[Any] | None:
    from kvjax.serve.swa_retraction import swa_retraction_parts

    return swa_retraction_parts(cache)


def _recurrent_parts(cache: KVCache) -> Sequence[Any] | None:
    from kvjax.serve.recurrent_retraction import recurrent_retraction_parts

    return recurrent_retraction_parts(cache)


def _swa(cache: KVCache) -> ServingExtension:
    from kvjax.serve.swa_extension import SWAServing

    return SWAServing(cache)


def _recurrent(cache: KVCache) -> ServingExtension | None:
    """``RecurrentStateExtension`` when this rank holds recurrent state (a pipeline stage may not)."""
    from kvjax.serve.recurrent_extension import RecurrentStateExtension, holds_state

    return RecurrentStateExtension(cache) if holds_state(cache) else None


def _host_tier(cache: KVCache) -> ServingExtension | None:
    if cache.host_pool is None:
        return None
    from kvjax.serve.host_tier import HostTierExtension

    return HostTierExtension(cache)


def _retraction(cache: KVCache) -> ServingExtension | None:
    from kvjax.serve.retraction_extension import retraction_extensions

    found = retraction_extensions(cache, retraction_parts(cache))
    return found[0] if found else None


for _kind in (
    ServingKind(names.REQUEST_TABLE),
    ServingKind(names.FULL, retraction_parts=_kv_pool),
    ServingKind(names.MLA, retraction_parts=_kv_pool),
    ServingKind(names.SWA, _swa, _swa_parts),
    ServingKind(names.RECURRENT, _recurrent, _recurrent_parts),
    ServingKind(names.HOST_TIER, _host_tier),
    ServingKind(names.RETRACTION, _retraction),
):
    register_serving_kind(_kind)
del _kind
