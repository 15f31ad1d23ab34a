"""Speculative decoding through the draft model's pools (SGLang's STANDALONE algorithm).

One concept per module: ``draft_view`` (the draft's pool as the draft model sees it),
``proposer`` (the draft's ``k + 1`` decode steps), ``verifier`` (the target's forward over the
round, greedy at every position), ``acceptance`` (greedy acceptance, pure numpy), ``rollback``
(the rejected tail's slots, target and draft at once), ``steps`` (the jitted steps) and
``draft_decoding`` (`DraftDecoding`, the way a `Scheduler` proposes tokens with a draft model,
and `speculative_scheduler`, a scheduler given one); EAGLE / NEXTN drafts with DeepSeek's MTP
layer: ``nextn`` (the layer), ``eagle_steps`` (its jitted steps) and ``eagle`` (`EagleDecoding`,
`eagle_scheduler`); EAGLE3 through the same steps with ``eagle3_draft`` (the draft and the target's
captured layers) and ``eagle3_checkpoint`` (reading a ``LlamaForCausalLMEagle3`` checkpoint).
"""

from __future__ import annotations

from kvjax.serve.speculative.draft_decoding import DraftDecoding, SpeculativeStats, speculative_scheduler
from kvjax.serve.speculative.eagle import EagleDecoding, eagle_scheduler

__all__ = ["DraftDecoding", "EagleDecoding", "SpeculativeStats", "eagle_scheduler", "speculative_scheduler"]
