"""The attention layer's kind registry: what ``attend`` runs for a layer of each cache kind's pool
(`AttentionKind`).

``attend`` finds the kind whose pool holds the layer (the ``CachePools`` entry ``pool``, of type
``pool_type``, listing the layer in ``layers(pool)``), in the kinds' order, and runs its
``attention`` with the uniform signature ``(pool, layer_id, q, k, v, meta, *, sm_scale, soft_cap,
sinks, sliding_window, mesh) -> (out, pool)`` (a kind adapts its own function in its module: MLA's
``attend_latent``). A kind with state but no attention (recurrent) names the refusal instead; a
kind without a pool of its own (the request table, the host tier, the retraction backup) registers
an empty record. The built-in kinds are registered when this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvjax.attention.hybrid_swa_attention import hybrid_swa_attention, swa_pool_layers
from kvjax.attention.mla_attention import attend_latent
from kvjax.attention.paged_attention import paged_attention
from kvjax.kinds import names
from kvjax.kinds.registry import KindRegistry
from kvjax.pools.mha import MHAKVPool
from kvjax.pools.mla import MLAKVPool
from kvjax.pools.recurrent import RecurrentStatePool
from kvjax.pools.swa import SWAKVPool

__all__ = ["ATTENTION_KINDS", "AttentionKind", "register_attention_kind"]


@dataclass(frozen=True)
class AttentionKind:
    """A cache kind's attention. Every field is optional.

    Attributes:
        name: the cache kind's name.
        attention: the function ``attend`` runs for a layer of its pool (uniform signature above),
            or None (no attention: ``attend`` refuses its layers with ``not_attention``).
        pool: the ``CachePools`` entry ``attend`` looks for its layers in, or None (no pool).
        pool_type: the class the entry must be an instance of to be this kind's (MHA and MLA pools
            share the entry ``"kv"``), or None (any).
        layers: ``(pool) -> tuple[int, ...]``, the global layer ids the pool holds (default: its
            ``layer_ids``, or its consecutive layers).
        not_attention: the message ``attend`` raises (``InvalidSlotError``) for a layer of its pool
            when the kind has no attention (``{layer_id}`` is filled in).
    """

    name: str
    attention: Callable[..., tuple[Any, Any]] | None = None
    pool: str | None = None
    pool_type: type | None = None
    layers: Callable[[Any], tuple[int, ...]] | None = None
    not_attention: str | None = None

    def owns(self, pool: Any) -> bool:
        """Whether ``pool`` is of this kind's pool type (any pool when the kind names none)."""
        return self.pool_type is None or isinstance(pool, self.pool_type)


ATTENTION_KINDS: KindRegistry[AttentionKind] = KindRegistry(
    "attention", "kvjax.attention.kinds.register_attention_kind"
)


def register_attention_kind(kind: AttentionKind) -> AttentionKind:
    """Add ``kind``'s attention; ``ConfigError`` (nothing changed) when its name is registered in
    this layer."""
    if not isinstance(kind, AttentionKind):
        raise TypeError(f"register_attention_kind: expected an AttentionKind, got {type(kind).__name__}")
    return ATTENTION_KINDS.register(kind.name, kind)


for _kind in (
    AttentionKind(names.REQUEST_TABLE),
    AttentionKind(names.FULL, attention=paged_attention, pool="kv", pool_type=MHAKVPool),
    AttentionKind(names.MLA, attention=attend_latent, pool="kv", pool_type=MLAKVPool),
    AttentionKind(names.SWA, attention=hybrid_swa_attention, pool="swa", pool_type=SWAKVPool, layers=swa_pool_layers),
    AttentionKind(
        names.RECURRENT,
        pool="recurrent",
        pool_type=RecurrentStatePool,
        not_attention=(
            "layer_id={layer_id} is a recurrent layer (pools.recurrent): run it with recurrent_step, not attend"
        ),
    ),
    AttentionKind(names.HOST_TIER),
    AttentionKind(names.RETRACTION),
):
    register_attention_kind(_kind)
del _kind
