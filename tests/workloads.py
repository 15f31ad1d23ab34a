"""Small serving workloads the tests share (``kvjax.serve.workload.Workload``; sizes in tokens).

The demo's two kinds of traffic, shared system prompts and multi-turn chats, small enough to serve
on a CPU in seconds, with prefix reuse (the groups' system prompts, the chats' earlier turns).
"""

from __future__ import annotations

import dataclasses

from kvjax.serve.workload import Workload

SMALL = Workload(
    groups=2,
    prompts_per_group=3,
    system_tokens=64,
    question_tokens=8,
    chats=2,
    turns=2,
    turn_tokens=16,
    output_tokens=4,
)
"""Two groups of 3 requests sharing a 64-token system prompt, and two chats of 2 turns: 10 requests."""

SMALL_THREE_GROUPS = dataclasses.replace(SMALL, groups=3)
"""``SMALL`` with a third group (13 requests): more groups than 2 DP ranks, so a router must put
two groups on one rank."""
