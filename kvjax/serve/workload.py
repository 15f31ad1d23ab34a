"""Built-in workloads that exercise prefix reuse, and the driver that runs them through a scheduler.

Two kinds of traffic, as LLM servers see them:

* **shared system prompts**: ``groups`` groups of ``prompts_per_group`` requests; the requests of
  a group share a ``system_tokens``-token system prompt and differ in a ``question_tokens``-token
  question;
* **multi-turn chats**: ``chats`` conversations of ``turns`` turns; each turn's prompt is the
  previous turn's prompt, plus the previous turn's *output*, plus ``turn_tokens`` new tokens. A turn
  is submitted only when the previous one has finished, as a chat client would.

Token ids are drawn from a seeded generator, so a workload is a pure function of its settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from kvjax.errors import ConfigError
from kvjax.serve.serving_front import ServingFront
from kvjax.serve.serving_req import ServingReq


@dataclasses.dataclass(frozen=True)
class Workload:
    """Sizes of the built-in workload (token counts)."""

    groups: int = 4
    prompts_per_group: int = 6
    system_tokens: int = 256
    question_tokens: int = 32
    chats: int = 4
    turns: int = 3
    turn_tokens: int = 48
    output_tokens: int = 16
    vocab_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts_per_group", "turns", "output_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), f"use {{{name}}} 1 or more")
        for name in ("groups", "system_tokens", "question_tokens", "chats", "turn_tokens", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), f"use {{{name}}} 0 or more")
        if self.num_requests == 0:
            raise ConfigError("groups", 0, "with {chats} 0 the workload has no request; use {groups} 1 or more")
        if self.groups and self.system_tokens + self.question_tokens == 0:
            raise ConfigError("system_tokens", 0, "a shared-prompt request needs tokens; use {system_tokens} 1 or more")
        if self.chats and self.turn_tokens == 0:
            raise ConfigError("turn_tokens", 0, "a chat turn needs new tokens; use {turn_tokens} 1 or more")

    def scaled(self, factor: float) -> Workload:
        """The same shape with ``factor`` times the requests (at least one of each kind)."""
        return dataclasses.replace(
            self,
            groups=max(1, round(self.groups * factor)),
            chats=max(1, round(self.chats * factor)),
        )

    @property
    def num_requests(self) -> int:
        return self.groups * self.prompts_per_group + self.chats * self.turns

    @property
    def longest_request_tokens(self) -> int:
        """Prompt plus output tokens of the workload's longest request (a chat's last turn holds
        every earlier turn and its output)."""
        shared = self.system_tokens + self.question_tokens + self.output_tokens if self.groups else 0
        chat = self.turns * (self.turn_tokens + self.output_tokens) if self.chats else 0
        return max(shared, chat)


def run_workload(
    scheduler: ServingFront, workload: Workload, *, on_finish: Callable[[ServingReq], None] | None = None
) -> dict[str, list[int]]:
    """Run every request of ``workload`` to completion; return each request's output by name.

    Names are ``"g{group}.{i}"`` and ``"c{chat}.{turn}"``. Shared-prompt requests are interleaved
    across groups; each chat's next turn is submitted when its previous turn finishes.
    """
    rng = np.random.default_rng(workload.seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, workload.vocab_size, n)]

    systems = [draw(workload.system_tokens) for _ in range(workload.groups)]
    first: list[ServingReq] = []
    for i in range(workload.prompts_per_group):
        for g in range(workload.groups):
            prompt = systems[g] + draw(workload.question_tokens)
            first.append(ServingReq(f"g{g}.{i}", prompt, max_new_tokens=workload.output_tokens))
    # Every turn's new tokens are drawn up front so the workload does not depend on finishing order.
    chat_turns = [[draw(workload.turn_tokens) for _ in range(workload.turns)] for _ in range(workload.chats)]
    for c in range(workload.chats):
        first.append(ServingReq(f"c{c}.0", chat_turns[c][0], max_new_tokens=workload.output_tokens))

    outputs: dict[str, list[int]] = {}
    scheduler.submit(first)
    while not scheduler.idle:
        for req in scheduler.step():
            rid = str(req.rid)
            outputs[rid] = list(req.output_ids)
            if on_finish is not None:
                on_finish(req)
            if rid.startswith("c"):
                chat, turn = (int(x) for x in rid[1:].split("."))
                if turn + 1 < workload.turns:
                    prompt = list(req.origin_input_ids) + list(req.output_ids) + chat_turns[chat][turn + 1]
                    scheduler.submit([ServingReq(f"c{chat}.{turn + 1}", prompt, max_new_tokens=workload.output_tokens)])
    return outputs
