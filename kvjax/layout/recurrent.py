"""The layout of the recurrent-state pool of hybrid SSM / linear-attention models, per rank
(jax-free): the one place its shapes and bytes are written.

Per tensor (each conv tensor, then the SSM tensor), one array over all recurrent layers::

    [num_recurrent_layers, num_slots + 1, *per_rank_shape]   (slot 0: the padding slot)

Tensor parallelism shards the state as SGLang does: the channel axis of a conv tensor
(``[channels, conv_kernel - 1]``) and the head axis of the SSM tensor (``[heads, head_dim,
state]``) are split evenly over the ranks (``RecurrentStateSpec.per_rank``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvjax.errors import ConfigError
from kvjax.layout import storage
from kvjax.layout.pool_plan import PoolPlan
from kvjax.spec import RecurrentStateSpec


@dataclass(frozen=True)
class RecurrentLayout:
    """Per-rank shapes of one recurrent layer's state (leading layer and slot axes excluded)."""

    conv_state_shapes: tuple[tuple[int, ...], ...]
    conv_dtype: str
    ssm_state_shape: tuple[int, ...]
    ssm_dtype: str
    tp_size: int

    @classmethod
    def per_rank(cls, state: RecurrentStateSpec, tp_size: int) -> RecurrentLayout:
        """The state one rank of ``tp_size`` holds, as SGLang shards it.

        ``RecurrentStateSpec.per_rank`` knows the mixer's sharding rules (heads split, a single B/C
        group replicated) and raises ``ConfigError`` on ``tp_size`` for a split SGLang refuses.
        """
        rank = state.per_rank(tp_size) if hasattr(state, "per_rank") else _even_split(state, tp_size)
        return cls(
            conv_state_shapes=tuple(tuple(s) for s in rank.conv_state_shapes),
            conv_dtype=rank.conv_dtype,
            ssm_state_shape=tuple(rank.ssm_state_shape),
            ssm_dtype=rank.ssm_dtype,
            tp_size=tp_size,
        )

    @property
    def bytes_per_slot_per_layer(self) -> int:
        """Bytes of one request's state in one layer, on one rank."""
        conv = sum(math.prod(s) for s in self.conv_state_shapes) * storage.itemsize(self.conv_dtype)
        return conv + math.prod(self.ssm_state_shape) * storage.itemsize(self.ssm_dtype)

    def pool_plans(self, *, num_slots: int, layer_ids: tuple[int, ...], built: bool) -> tuple[PoolPlan, ...]:
        """``conv_state_<i>`` per conv tensor and ``ssm_state``, each ``[layers, num_slots + 1, ...]``."""
        layers = len(layer_ids)
        rows = num_slots + 1
        tensors = [(f"conv_state_{i}", s, self.conv_dtype) for i, s in enumerate(self.conv_state_shapes)]
        tensors.append(("ssm_state", self.ssm_state_shape, self.ssm_dtype))
        return tuple(
            PoolPlan(
                name,
                "recurrent",
                (layers, rows, *shape),
                dtype,
                1,
                layers * rows * math.prod(shape) * storage.itemsize(dtype),
                built=built,
                layer_ids=layer_ids,
                layout=self,
            )
            for name, shape, dtype in tensors
        )


def _even_split(state: RecurrentStateSpec, tp_size: int) -> RecurrentStateSpec:
    """Axis 0 of every tensor split evenly over ``tp_size`` (``ConfigError`` when it does not divide)."""

    def split(shape: tuple[int, ...]) -> tuple[int, ...]:
        if shape[0] % tp_size:
            raise ConfigError(
                "tp_size",
                tp_size,
                f"the recurrent state's {shape[0]} channels/heads do not split evenly; use a divisor",
            )
        return (shape[0] // tp_size, *shape[1:])

    return dataclasses.replace(
        state,
        conv_state_shapes=tuple(split(s) for s in state.conv_state_shapes),
        ssm_state_shape=split(state.ssm_state_shape),
    )
