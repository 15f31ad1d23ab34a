"""`SlidingWindows`: which layers of a served model attend through a sliding window, and how far.

Read from the spec's layer kinds (``ModelSpec.layer_kinds``, ``sliding_attention`` layers) and its
``sliding_window``; the spec guarantees a positive window exactly when some layer slides. A
sliding layer sees keys in ``(p - sliding_window, p]`` (Transformers' sliding mask); a full layer
sees every earlier key. The families with sliding layers (Llama-like checkpoints with a window,
Gemma 3, gpt-oss) keep one of these, or a subclass of it, as their family config.
"""

from __future__ import annotations

import dataclasses

from kvjax.errors import ConfigError
from kvjax.spec import LayerKind, ModelSpec

__all__ = ["SlidingWindows", "read_sliding_windows", "sliding_windows"]


@dataclasses.dataclass(frozen=True)
class SlidingWindows:
    """``sliding[i]``: whether layer ``i`` slides; ``sliding_window``: ``W`` tokens (> 0)."""

    sliding: tuple[bool, ...]
    sliding_window: int

    def window(self, layer_id: int) -> int | None:
        """``attend``'s ``sliding_window`` for global layer ``layer_id``: ``W`` for a sliding
        layer, None for a full-attention one."""
        return self.sliding_window if self.sliding[layer_id] else None


def sliding_windows(spec: ModelSpec) -> SlidingWindows | None:
    """The spec's sliding layers and window, or None when every layer is full attention."""
    sliding = tuple(kind == LayerKind.SLIDING for kind in spec.layer_kinds)
    if not any(sliding) or not spec.sliding_window:
        return None
    return SlidingWindows(sliding, int(spec.sliding_window))


def read_sliding_windows(spec: ModelSpec, family: str) -> SlidingWindows:
    """``sliding_windows(spec)`` for a family whose layers always include sliding ones; a
    `ConfigError` naming ``family`` when the spec has no positive ``sliding_window``."""
    windows = sliding_windows(spec)
    if windows is None:
        raise ConfigError("sliding_window", spec.sliding_window, f"{family} needs a positive sliding_window")
    return windows
