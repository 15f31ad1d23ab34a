"""Where a recurrent-state tree keeps checkpoints (jax-free).

A hybrid recurrent model can resume only from a stored state, so a cached prefix is reusable up
to the deepest checkpoint on its path, not up to its FULL KV. Each checkpoint costs one state slot
(the ``qwen3-next-80b-a3b`` preset's plan: 73.7 MiB per state at TP 1, the KV of about 3,000
tokens at 24 KiB per token), so where to keep them trades hit rate against state memory. SGLang (without the
extra buffer) keeps one at every caching point: each ``cache_unfinished_req`` (every prefill
chunk end and decode checkpoint) and each finish. :class:`CheckpointPolicy` makes that explicit
and lets a deployment keep a subset. The points, for one request:

=================  =========================================  ============================================
point              when (``MambaRadixCache`` lifecycle)        what it buys
=================  =========================================  ============================================
``chunk_ends``     ``cache_unfinished_req`` before the prompt  a hit at a chunk boundary of a long prompt
                   is done (a prefill chunk ended)             another request shares in part
``prompt_end``     ``cache_unfinished_req`` once the whole     a hit on the whole prompt (same prompt again,
                   prompt ran, and decode checkpoints           or a new question after the same context)
``turn_end``       ``cache_finished_req`` (prompt + output)    a multi-turn chat's next turn, which starts
                                                               with this turn's prompt and output
=================  =========================================  ============================================

A point the policy skips still caches its FULL KV (a node without a checkpoint), so a deeper
checkpoint on the same path still reuses it. ``benchmarks/recurrent_state.py`` measures the hit
rate each policy buys on the multi-turn workload against the full-attention upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CheckpointPolicy", "POLICIES"]


@dataclass(frozen=True)
class CheckpointPolicy:
    """Which caching points donate a checkpoint (see the module docstring).

    Called by ``MambaRadixCache`` as ``policy(req, cache_len, is_finished) -> bool``: the
    point is a turn end when ``is_finished``, a prompt end when ``cache_len`` covers the
    request's page-aligned prompt, else a chunk end.
    """

    chunk_ends: bool = True
    prompt_end: bool = True
    turn_end: bool = True

    def point(self, prompt_len: int, cache_len: int, is_finished: bool) -> str:
        """``"turn_end"``, ``"prompt_end"`` or ``"chunk_ends"`` for a caching point of a request
        whose prompt has ``prompt_len`` tokens, caching ``cache_len`` tokens."""
        if is_finished:
            return "turn_end"
        return "prompt_end" if cache_len >= prompt_len else "chunk_ends"

    def keeps(self, point: str) -> bool:
        """Whether this policy donates a checkpoint at ``point``."""
        if point not in ("chunk_ends", "prompt_end", "turn_end"):
            raise ValueError(f"unknown checkpoint point {point!r}; use chunk_ends, prompt_end or turn_end")
        return bool(getattr(self, point))

    def __call__(self, req: Any, cache_len: int, is_finished: bool) -> bool:
        inp = req.origin_input_ids
        prompt_len = int(inp.shape[0]) if hasattr(inp, "shape") else len(inp)
        return self.keeps(self.point(prompt_len, cache_len, is_finished))

    @property
    def name(self) -> str:
        kept = [p for p in ("chunk_ends", "prompt_end", "turn_end") if getattr(self, p)]
        return "+".join(kept) if kept else "none"


#: The policies the benchmark compares; ``all`` is SGLang's behaviour.
POLICIES: dict[str, CheckpointPolicy] = {
    "all": CheckpointPolicy(),
    "turn_end": CheckpointPolicy(chunk_ends=False, prompt_end=False, turn_end=True),
    "prompt_end": CheckpointPolicy(chunk_ends=False, prompt_end=True, turn_end=False),
    "prompt_and_turn_end": CheckpointPolicy(chunk_ends=False, prompt_end=True, turn_end=True),
    "chunk_ends": CheckpointPolicy(chunk_ends=True, prompt_end=False, turn_end=False),
    "none": CheckpointPolicy(chunk_ends=False, prompt_end=False, turn_end=False),
}
