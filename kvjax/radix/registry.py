"""`create_tree_cache`: the prefix cache a plan asks for.

Mirrors SGLang's newest default chain (everything is one tree with components), restricted to
what is built: the plan's typed :class:`TreeOptions` pick the tree, and everything the tree
holds (allocators, the host tier's transfer engine, the storage tier) is passed to its
constructor. The cache kinds own the trees (``HostKind.tree_builders``, ``kvjax.radix.kinds``): a
``tree_cache_kind`` of a kind's own tree, or the unified tree's components joined with ``"+"``,
maps to the builder that kind registered; the components and their labels are the kinds'
planner registrations' (``PlannerKind.tree_components``); this module names none of them. Components no kind
builds together raise ``NotImplementedError`` naming them, never a silent fallback.

=====================  ==========================================================
plan                   tree (the kind that builds it)
=====================  ==========================================================
``chunk``              :class:`ChunkCache` (full)
``unified``, full only :class:`RadixCache` (``disable=True`` when the radix cache is
                       disabled: SGLang builds a disabled tree that behaves like a
                       chunk cache when chunked prefill is off); host tier attached:
                       :class:`HiRadixCache` (the host allocator, transfer engine and
                       storage tier come from the build, else a host allocator of
                       ``host_pool_tokens`` and a simulated engine) (full)
``unified`` + swa      :class:`SWARadixCache` (radix disabled: :class:`SWAChunkCache`, which
                       behaves as SGLang's disabled tree); with a host tier
                       :class:`HiSWARadixCache` (swa)
``unified`` + mamba    :class:`MambaRadixCache` (state slots from the request table's
                       ``mamba_allocator``; extra buffer and per-path cap from the plan);
                       with the host tier :class:`HiMambaRadixCache` (the state engine
                       beside the KV's from the build) (recurrent)
swa + mamba            NotImplementedError (no kind builds both in one tree)
``swa_chunk``          :class:`SWAChunkCache` (needs the SWA allocator) (swa)
``pure_swa_chunk``     :class:`PureSWAChunkCache` (swa)
``pure_swa_radix``     :class:`PureSWARadixCache` (the SWA pool's plain allocator); with a
                       host tier: NotImplementedError (swa)
=====================  ==========================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvjax.errors import ConfigError
from kvjax.plan.kinds import PlannerKind, planner_kinds
from kvjax.plan.tree_options import TreeOptions
from kvjax.radix.events import EventSink
from kvjax.radix.kinds import HOST_KINDS, TreeBuilder
from kvjax.radix.storage_link import StorageOptions
from kvjax.radix.tree_inputs import TreeInputs

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol, TreeCacheProtocol
    from kvjax.tiers import CopyEngine, HostSlotAllocator

UNIFIED = "unified"
COMPONENT_SEPARATOR = "+"  # the unified tree's builder key: its components joined


def _builders() -> dict[str, TreeBuilder]:
    """Every registered kind's tree builders by key (registry order; keys are unique)."""
    return {key: build for kind in HOST_KINDS for key, build in kind.tree_builders.items()}


def tree_cache_kinds() -> tuple[str, ...]:
    """The ``tree_cache_kind`` values the registered kinds build (their own trees, then ``unified``)."""
    return tuple(k for k in _builders() if COMPONENT_SEPARATOR not in k and k not in _components()) + (UNIFIED,)


def _components() -> tuple[str, ...]:
    """Every tree component a registered kind contributes, each once, in registry order."""
    return tuple(dict.fromkeys(c for kind in planner_kinds() for c in kind.tree_components))


class HasTreeOptions(Protocol):
    """A cache plan (``kvjax.plan.CachePlan``): anything that carries its :class:`TreeOptions`
    (the plan types are not imported here: ``kvjax.radix`` stays free of jax)."""

    @property
    def tree_options(self) -> TreeOptions: ...


def create_tree_cache(
    plan: TreeOptions | HasTreeOptions,
    *,
    req_to_token_pool: ReqToTokenPoolProtocol | None = None,
    token_to_kv_pool_allocator: AllocatorProtocol | None = None,
    event_sink: EventSink | None = None,
    host_allocator: HostSlotAllocator | None = None,
    host_engine: CopyEngine | None = None,
    storage: StorageOptions | None = None,
) -> TreeCacheProtocol:
    """Build the prefix cache described by ``plan`` (its :class:`TreeOptions`, or a plan whose
    ``tree_options`` they are), with everything it holds given now: ``host_allocator`` (the host
    pool's slot allocator; default: one of ``host_pool_tokens``), ``host_engine`` (the host tier's
    transfers; default: simulated) and ``storage`` (the storage tier behind the host tier; None:
    none). The last three need a plan with the host tier (``attach_host_tier``).

    Raises:
        TypeError: ``plan`` is neither a ``TreeOptions`` nor carries one.
        ConfigError: an unknown ``tree_cache_kind``, component or eviction policy; a host
            allocator, engine or storage tier for a plan without the host tier.
        NotImplementedError: a kind or component that is not built yet (named).
    """
    options = plan if isinstance(plan, TreeOptions) else getattr(plan, "tree_options", None)
    if not isinstance(options, TreeOptions):
        raise TypeError(
            f"create_tree_cache: expected TreeOptions or a plan with .tree_options, got {type(plan).__name__}"
        )
    return _create(
        options,
        TreeInputs(
            options,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            event_sink=event_sink,
            host_allocator=host_allocator,
            host_engine=host_engine,
            storage=storage,
        ),
    )


def _create(o: TreeOptions, inputs: TreeInputs) -> TreeCacheProtocol:
    kind = o.tree_cache_kind
    builders = _builders()
    known = tree_cache_kinds()
    if kind not in known:
        raise ConfigError("tree_cache_kind", kind, f"use one of {', '.join(known)}")
    if not o.attach_host_tier:
        for name in ("host_allocator", "host_engine", "storage"):
            given = getattr(inputs, name)
            if given is not None:
                raise ConfigError(name, type(given).__name__, "the plan has no host tier (attach_host_tier); drop it")
    if kind != UNIFIED:
        return builders[kind](o, inputs)
    components = tuple(o.tree_components or ("full",))
    known = _components()
    unknown = [c for c in components if c not in known]
    if unknown:
        named = ", ".join(repr(c) for c in known[:-1]) + f" and {known[-1]!r}"
        raise ConfigError("tree_components", components, f"components are {named}")
    if o.attach_host_tier:
        for component in components:
            missing = _owner(component).no_host_copy
            if missing is not None:
                raise NotImplementedError(
                    f"tree_components={components!r} with the host tier needs a host copy of {missing}, which is "
                    "not built yet; turn off enable_hierarchical_cache for this model"
                )
    build = builders.get(COMPONENT_SEPARATOR.join(components))
    if build is None:
        labels = [_owner(c).tree_label or c for c in components[1:] or components]
        both = " (both components in one tree)" if len(labels) == 2 else ""
        raise NotImplementedError(
            f"tree_components={components!r} needs the {' + '.join(labels)} tree{both}, which is not built yet"
        )
    return build(o, inputs)


def _owner(component: str) -> PlannerKind:
    """The first registered kind that contributes ``component`` to the unified tree."""
    return next(kind for kind in planner_kinds() if component in kind.tree_components)
