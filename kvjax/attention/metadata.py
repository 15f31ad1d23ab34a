"""`AttentionMetadata`: where one ragged batch's tokens live in the cache, as typed fields.

A batch is ``T`` tokens (padded to a bucket) of up to ``S`` sequence rows (padded to the step's
fixed row count). Every field is an int32 array: numpy on the host (``MetadataBuilder`` packs
them there), device arrays inside a jitted step (the jitted call copies them). The metadata is a
pytree, so it passes through ``jax.jit`` as an argument; the kind-specific parts are ``None``
when the cache has no such kind (``None`` is an empty subtree: a step compiled for an MHA model
carries nothing for them).

Parts, one per kind of pool beyond full attention:

* ``SWAMetadata`` (field ``swa``): a hybrid sliding-window pool's own slots and page table for
  the sliding layers (the full layers use the common ``out_loc`` / ``page_indices``).
* ``StateMetadata`` (field ``state``): the recurrent-state slots of the sequence rows.

Each part class names its field in ``AttentionMetadata`` (``FIELD``), so a producer (a serving
extension's ``step_metadata`` hook) returns a part and the builder places it without a branch on
the kind. A kind registered outside kvjax (``kvjax.serve.kinds.register_serving_kind``) brings its own
part class (any pytree with a ``FIELD`` naming the kind: the ``MetadataPart`` protocol); it is
placed in ``AttentionMetadata.extra`` under that name and read back with ``meta.part(name)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import jax
import jax.numpy as jnp

__all__ = ["AttentionMetadata", "KindMetadata", "MetadataPart", "SWAMetadata", "StateMetadata", "trace_metadata"]

_Part = TypeVar("_Part")


@runtime_checkable
class MetadataPart(Protocol):
    """A kind-specific part of ``AttentionMetadata``: a pytree (e.g. a dataclass registered with
    ``jax.tree_util.register_dataclass``) whose class names where it goes (``FIELD``: ``"swa"``
    and ``"state"`` are the built-in fields; any other name lands in ``AttentionMetadata.extra``).

    A part may also name its per-token fields (``TOKEN_FIELDS``, arrays ``[T]`` padded with the
    batch's tokens, e.g. its own ``out_loc``); the default is none.
    """

    FIELD: ClassVar[str]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SWAMetadata:
    """The sliding layers' inputs of a hybrid sliding-window pool (``pools.swa``).

    Attributes:
        out_loc: int32 ``[T]``: the SWA-pool slot each new token's K/V is written to (0, the
            trash page, for padding tokens).
        page_indices: int32 ``[S, pages_per_seq]``: each row's page table in the SWA pool. Pages
            whose SWA slots were freed (out of the window) and padding rows are 0; the attention
            kernel never reads them (they lie outside every query's window).
    """

    FIELD: ClassVar[str] = "swa"
    TOKEN_FIELDS: ClassVar[tuple[str, ...]] = ("out_loc",)

    out_loc: jax.Array
    page_indices: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateMetadata:
    """The recurrent-state inputs of the sequence rows (``pools.recurrent``).

    Attributes:
        state_slots: int32 ``[S]``: each row's state slot (0, the padding slot, for padding rows).
        has_initial_state: int32 ``[S]``: 1 where the row continues the state in its slot (a
            chunk continuation, a decode step, a checkpoint forked at the match), 0 where its
            sequence starts in this step from zero state.
        track_slots: int32 ``[S]``: where the state after the row's ``track_at``-th token of this
            step is also written (a ping-pong slot of the extra buffer), 0 when nothing is tracked.
        track_at: int32 ``[S]``: that token's 1-based index within the row's tokens of this step;
            0 when nothing is tracked (the row then writes its zero track state to slot 0).
    """

    FIELD: ClassVar[str] = "state"

    state_slots: jax.Array
    has_initial_state: jax.Array
    track_slots: jax.Array
    track_at: jax.Array


KindMetadata = SWAMetadata | StateMetadata
"""The built-in kind-specific parts of ``AttentionMetadata`` (each placed at its class's ``FIELD``)."""

_BUILT_IN_PARTS = frozenset({SWAMetadata.FIELD, StateMetadata.FIELD})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where a ragged batch's tokens live: ``T`` tokens (padded), ``S`` sequence rows (padded).

    Invariants: sequence ``s`` owns tokens ``cu_q_lens[s]:cu_q_lens[s + 1]``, which sit at
    positions ``kv_lens[s] - q_len(s) ... kv_lens[s] - 1`` of its sequence; rows
    ``num_seqs[0]:`` are padding (``kv_lens`` 0, page table 0, ``cu_q_lens`` constant); tokens
    past ``cu_q_lens[num_seqs[0]]`` are padding (position 0, slot 0: the trash page).

    Attributes:
        positions: int32 ``[T]``: position of each token in its sequence (0 for padding).
        out_loc: int32 ``[T]``: the full-attention KV slot each token's K/V is written to (0 for
            padding). A slot is ``page * page_size + offset``.
        kv_lens: int32 ``[S]``: KV length of each row including this batch's tokens (0 for padding).
        page_indices: int32 ``[S, pages_per_seq]``: each row's page table in the full-attention
            pool (page ids; 0 beyond the row's pages and in padding rows).
        cu_q_lens: int32 ``[S + 1]``: token offsets of the rows in the batch.
        num_seqs: int32 ``[1]``: live rows.
        logits_indices: int32 ``[S]``: index of each row's last token (0 for padding rows).
        swa: the sliding layers' slots and page table of a hybrid sliding-window pool, or None.
        state: the rows' recurrent-state slots, or None.
        extra: the parts of kinds registered outside kvjax, by their ``FIELD`` (empty for
            kvjax's own kinds); read one with :meth:`part`.
        checked: static: the step checks its slot and page ids inside ``jit`` (:meth:`with_checks`).
    """

    positions: jax.Array
    out_loc: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    swa: SWAMetadata | None = None
    state: StateMetadata | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    checked: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def with_checks(self) -> AttentionMetadata:
        """This metadata, asking the step to check its slot and page ids inside ``jit``: run the
        step under ``jax.experimental.checkify.checkify`` and ``err.throw()`` names an id outside
        the pool, which a plain step routes to the trash page and drops. Off by default: a check
        is a JAX effect, and a jitted function with one loses JAX's fast dispatch path. The flag
        is static (part of the jit cache key), so checked and plain steps compile apart."""
        return dataclasses.replace(self, checked=True)

    def with_parts(self, *parts: MetadataPart | None) -> AttentionMetadata:
        """A copy with each kind part placed at its field (``None`` parts are skipped): a
        built-in part at ``swa`` / ``state``, another kind's in ``extra`` under its ``FIELD``."""
        changes, extra = place_parts(parts)
        if extra:
            changes["extra"] = {**self.extra, **extra}
        return dataclasses.replace(self, **changes) if changes else self

    def parts(self) -> tuple[MetadataPart, ...]:
        """Every kind part present: the built-in fields set, then ``extra``'s in key order."""
        built_in = (getattr(self, name) for name in sorted(_BUILT_IN_PARTS))
        return (*(p for p in built_in if p is not None), *(self.extra[k] for k in sorted(self.extra)))

    def part(self, name: str) -> Any:
        """The part of the kind registered outside kvjax as ``name`` (``KeyError`` naming the
        parts present otherwise)."""
        try:
            return self.extra[name]
        except KeyError:
            raise KeyError(
                f"AttentionMetadata has no part {name!r} (parts present: {sorted(self.extra)}); the kind's "
                "serving extension produces it from step_metadata"
            ) from None

    def as_device_arrays(self) -> AttentionMetadata:
        """The metadata with every leaf a ``jax.Array`` (a no-op inside a jitted step, where they are
        already; outside one, numpy leaves from the host builder are copied to the device)."""
        return jax.tree.map(jnp.asarray, self)

    def require_swa(self) -> SWAMetadata:
        """The SWA part (``ValueError`` naming what produces it when absent)."""
        return _present(
            self.swa,
            "a sliding layer of a hybrid SWA pool needs AttentionMetadata.swa (its own slots and page "
            "table); build the metadata with an SWAMetadata part (the SWA serving extension's step_metadata)",
        )

    def require_state(self) -> StateMetadata:
        """The recurrent-state part (``ValueError`` naming what produces it when absent)."""
        return _present(
            self.state,
            "a recurrent layer needs AttentionMetadata.state (the rows' state slots); build the metadata "
            "with a StateMetadata part (the recurrent-state serving extension's step_metadata)",
        )


def _present(part: _Part | None, missing: str) -> _Part:
    """``part``, or ``ValueError(missing)`` when it is None."""
    if part is None:
        raise ValueError(missing)
    return part


def place_parts(parts: Sequence[MetadataPart | None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(built-in fields, extra)``: each part by its ``FIELD``, ``None`` skipped.

    Raises:
        ValueError: two parts for the same field (one producer per kind), or a part without
            a ``FIELD``.
    """
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for part in parts:
        if part is None:
            continue
        name = getattr(part, "FIELD", None)
        if not isinstance(name, str):
            raise ValueError(f"{type(part).__name__} is not a metadata part: give its class a FIELD naming its kind")
        target = fields if name in _BUILT_IN_PARTS else extra
        if name in target:
            raise ValueError(
                f"two {type(part).__name__} parts for AttentionMetadata field {name!r}; one producer per kind"
            )
        target[name] = part
    return fields, extra


def trace_metadata(*parts: MetadataPart | None) -> AttentionMetadata:
    """The metadata of one padding token in one row over one page (for tracing a model's weights),
    with the given kind parts."""
    meta = AttentionMetadata(
        positions=jnp.zeros((1,), jnp.int32),
        out_loc=jnp.zeros((1,), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32),
        page_indices=jnp.zeros((1, 1), jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
        logits_indices=jnp.zeros((1,), jnp.int32),
    )
    return meta.with_parts(*parts)
