"""The pools layer's kind registry: how each cache kind's pools are built (`PoolBuilders`).

The planner tags each ``PoolPlan`` with a pool kind (``PoolPlan.kind``, declared by the cache
kind's ``PlannerKind.pool_kinds``); this registry maps the pool kind to the function that builds
it, registered by the cache kind under its name (``kvjax.kinds.registry``). ``build_kv_cache``
builds a plan's pools with ``create_pool`` (one ``PoolPlan`` -> one pool) and ``create_pool_group``
(every ``PoolPlan`` of a grouped pool kind -> one pool, stored under the pool kind's name: the
recurrent state, the sliding-window pair). A pool kind the plan says is built but no kind gives a
builder for raises ``NotImplementedError`` naming its capability.

The built-in kinds' builders are registered when this module is imported (it imports the pools).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvjax.kinds import names
from kvjax.kinds.registry import KindRegistry
from kvjax.layout.build_context import BuildContext
from kvjax.plan.kinds import pool_kind

if TYPE_CHECKING:
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.transfers.transfer_engines import TransferContext

__all__ = [
    "POOL_BUILDERS",
    "BuildContext",
    "PoolBuilders",
    "create_pool",
    "create_pool_group",
    "is_grouped",
    "register_pool_builders",
    "request_kv_of",
    "require_builder",
]

PoolBuilder = Callable[["PoolPlan", BuildContext], Any]
GroupBuilder = Callable[[tuple["PoolPlan", ...], BuildContext], Any]


@dataclass(frozen=True)
class PoolBuilders:
    """A cache kind's pool builders. Every field is optional: a kind without pools of its own (the
    retraction backup) registers an empty record.

    Attributes:
        name: the cache kind's name.
        builders: ``{pool kind: builder}``, each building one pool from ``(PoolPlan, BuildContext)``.
        group_builders: ``{pool kind: builder}``, each building *every* ``PoolPlan`` of that pool
            kind in a plan as one pool from ``(tuple[PoolPlan, ...], BuildContext)``, stored under
            the pool kind's name.
        transfer_engine: ``(TransferContext) -> engine | None``, the host tier's page transfer
            engine over this kind's pools when the plain one does not fit them (the sliding-window
            pair moves both sides; ``kvjax.transfers.transfer_engines``).
        request_kv: ``{pool kind: RequestKV}``, how a request's share of each of its pools moves
            between servers (prefill/decode disaggregation; ``kvjax.transfers.request_kv``).
    """

    name: str
    builders: Mapping[str, PoolBuilder] = field(default_factory=dict)
    group_builders: Mapping[str, GroupBuilder] = field(default_factory=dict)
    transfer_engine: Callable[[TransferContext], Any] | None = None
    request_kv: Mapping[str, Any] = field(default_factory=dict)


POOL_BUILDERS: KindRegistry[PoolBuilders] = KindRegistry("pools", "kvjax.pools.registry.register_pool_builders")


def register_pool_builders(kind: PoolBuilders) -> PoolBuilders:
    """Add ``kind``'s pool builders; ``ConfigError`` (nothing changed) when its name is registered in
    this layer or one of its pool kinds has a builder already."""
    if not isinstance(kind, PoolBuilders):
        raise TypeError(f"register_pool_builders: expected PoolBuilders, got {type(kind).__name__}")
    from kvjax.errors import ConfigError

    taken = {pool: other.name for other in POOL_BUILDERS for pool in (*other.builders, *other.group_builders)}
    mine = [*kind.builders, *kind.group_builders]
    clash = sorted({p for p in mine if p in taken} | {p for p in mine if mine.count(p) > 1})
    if clash:
        raise ConfigError(
            "pool kind", clash[0], f"cache kind {kind.name!r}: its builder is registered by {taken.get(clash[0])!r}"
        )
    return POOL_BUILDERS.register(kind.name, kind)


def request_kv_of(kind: str) -> Any:
    """The ``RequestKV`` registered for pool kind ``kind``; ``NotImplementedError`` naming it when
    no cache kind says how its pools move between servers."""
    for entry in POOL_BUILDERS:
        if kind in entry.request_kv:
            return entry.request_kv[kind]
    raise NotImplementedError(
        f"pools of kind {kind!r} cannot move between servers: no cache kind registered how (PoolBuilders.request_kv)"
    )


def _builder(kind: str) -> tuple[PoolBuilder | None, GroupBuilder | None]:
    for entry in POOL_BUILDERS:
        if kind in entry.builders:
            return entry.builders[kind], None
        if kind in entry.group_builders:
            return None, entry.group_builders[kind]
    return None, None


def require_builder(kind: str, model: str) -> None:
    """``NotImplementedError`` naming the capability when pool kind ``kind`` is not built (the plan
    says so, or no kind registered its builder); ``ConfigError`` for an unknown pool kind."""
    declared = pool_kind(kind)
    declared.require_built(model)
    if _builder(kind) == (None, None):
        raise NotImplementedError(
            f"kvjax cannot build {declared.capability} (pool kind {kind!r}) for {model}: no cache kind registered "
            "its builder (kvjax.pools.registry.register_pool_builders)"
        )


def is_grouped(kind: str) -> bool:
    """Whether every pool of ``kind`` in a plan is built together as one (``group_builders``)."""
    return _builder(kind)[1] is not None


def create_pool(pool: PoolPlan, context: BuildContext) -> Any:
    """Build ``pool`` with its pool kind's builder."""
    require_builder(pool.kind, f"pool {pool.name!r}")
    make = _builder(pool.kind)[0]
    if make is None:
        raise ValueError(f"pool kind {pool.kind!r} is built as a group; use create_pool_group")
    return make(pool, context)


def create_pool_group(kind: str, pools: tuple[PoolPlan, ...], context: BuildContext) -> Any:
    """Build every pool of pool kind ``kind`` in a plan as one pool (its group builder)."""
    require_builder(kind, f"pools {[p.name for p in pools]}")
    make = _builder(kind)[1]
    if make is None:
        raise ValueError(f"pool kind {kind!r} is built one pool at a time; use create_pool")
    return make(pools, context)


def _register_builtin_kinds() -> None:
    from kvjax import req_pool
    from kvjax.pools import mha, mla, recurrent, swa
    from kvjax.tiers import host_pool, host_state_pool
    from kvjax.transfers import state_transfer, swa_transfer
    from kvjax.transfers.request_kv import PagedRequestKV, RecurrentRequestKV, SWARequestKV

    for kind in (
        PoolBuilders(names.REQUEST_TABLE, builders={"request_table": req_pool.create_pool}),
        PoolBuilders(names.FULL, builders={"mha": mha.create_pool}, request_kv={"mha": PagedRequestKV()}),
        PoolBuilders(names.MLA, builders={"mla": mla.create_pool}, request_kv={"mla": PagedRequestKV()}),
        PoolBuilders(
            names.SWA,
            group_builders={"swa": swa.create_pool_group},
            transfer_engine=swa_transfer.transfer_engine,
            request_kv={"swa": SWARequestKV()},
        ),
        PoolBuilders(
            names.RECURRENT,
            builders={"host_state": host_state_pool.create_host_state_pool},
            group_builders={"recurrent": recurrent.create_pool_group},
            transfer_engine=state_transfer.transfer_engine,
            request_kv={"recurrent": RecurrentRequestKV()},
        ),
        PoolBuilders(names.HOST_TIER, builders={"host_tier": host_pool.create_host_pool}),
        PoolBuilders(names.RETRACTION),
    ):
        register_pool_builders(kind)


_register_builtin_kinds()
