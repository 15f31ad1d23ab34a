"""Host-tier completions agreed across two real processes: with an injected delay on one
process's transfers, every tree stays equal at every step; without the agreement the per-step
digests diverge and the check names the step.

Each process (``jax.distributed`` on loopback, one CPU device) drives its own ``HiRadixCache``
over a real device allocator and host pool, identically: inserts of requests sharing system
prompts (write-through backups), device eviction (which pending backups block), host hits
loaded back. The device side is the ``SimulatedCopyEngine``; process 1's engine needs 3 polls
per transfer and process 0's 1 (the injected delay). Polls go through ``AgreedCopyEngine`` over
a ``ProcessAgreement`` (MIN over processes) or, for the control run, a ``LocalAgreement``.
After every step each process's digest (tree, device allocator, host allocator) is gathered and
compared (``kvjax.multihost.digest``).

Run as a program (``python -m tests.mesh.test_multihost_agreement MODE``) it is one process of
the group.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from tests.mesh.multihost_group import assert_all_ok, join, parse_group_args, run_group

STEPS = 24
DELAY_POLLS = {0: 1, 1: 3}  # polls a transfer needs to land, per process


def test_delayed_completions_are_agreed_and_every_step_digest_is_equal():
    reports = assert_all_ok(run_group(["-m", "tests.mesh.test_multihost_agreement", "agreed"], devices=1, timeout=90))
    assert all(r["diverged_at"] is None for r in reports), reports
    assert reports[0]["steps"] == reports[1]["steps"] == STEPS
    assert reports[0]["digests"] == reports[1]["digests"]
    # the delay mattered: process 0 saw transfers land that it had to wait for process 1 on
    assert reports[0]["held_back"] > 0 and reports[1]["held_back"] == 0
    # the scenario exercised what completions gate: backups, eviction, load-back
    assert all(r["evicted"] > 0 and r["loaded"] > 0 and r["backups"] > 0 for r in reports), reports


def test_without_the_agreement_the_digest_check_names_the_first_divergent_step():
    reports = assert_all_ok(run_group(["-m", "tests.mesh.test_multihost_agreement", "local"], devices=1, timeout=90))
    steps = {r["diverged_at"] for r in reports}
    assert len(steps) == 1 and None not in steps, reports
    assert "tree" in reports[0]["message"] and f"step {steps.pop()}" in reports[0]["message"]


def _scenario(mode: str) -> dict:
    args, rest = parse_group_args()
    group = join(args)
    from kvjax.alloc import make_allocator
    from kvjax.multihost.agreement import LocalAgreement
    from kvjax.multihost.channel import all_gather_message
    from kvjax.multihost.digest import StateDigest, allocator_digest, compare_digests, tree_digest
    from kvjax.multihost.errors import DivergenceError
    from kvjax.radix import HiRadixCache
    from kvjax.tiers import SimulatedCopyEngine
    from kvjax.tiers.agreed_copy_engine import AgreedCopyEngine

    alloc = make_allocator(48, 1)
    engine = SimulatedCopyEngine(polls_to_finish=DELAY_POLLS[group.process_id])
    tree = HiRadixCache(
        page_size=1, token_to_kv_pool_allocator=alloc, host_pool_tokens=256, copy_engine=engine, load_back_threshold=2
    )
    agreement = group.agreement() if mode == "agreed" else LocalAgreement()
    agreed = AgreedCopyEngine(tree.host.engine, agreement)
    tree.host.engine = agreed
    rng = np.random.default_rng(0)
    systems = [[int(t) for t in rng.integers(0, 50, 8)] for _ in range(3)]
    history: list[list[int]] = []
    evicted = loaded = 0
    digests = []
    report: dict = {"diverged_at": None, "message": ""}
    for step in range(STEPS):
        agreed.agree_round()
        tree.check_transfers()
        if step % 5 == 4 and history:  # a returning request: its evicted prefix is a host hit
            match = tree.match_prefix(history[(step // 5) % len(history)])
            quota = alloc.available_size() + tree.evictable_size()
            before = match.prefix_len
            loaded += max(0, tree.init_load_back(match, mem_quota=quota).prefix_len - before)
        tokens = systems[step % 3] + [int(t) for t in rng.integers(50, 100, 6)]
        history.append(tokens)
        if alloc.available_size() < len(tokens):
            evicted += tree.evict(len(tokens) - alloc.available_size())
        slots = alloc.alloc(len(tokens))
        if slots is not None:
            prefix = tree.insert(tokens, slots)
            held = tree.match_prefix(tokens).indices[:prefix]
            alloc.free(slots[:prefix][slots[:prefix] != held])
        if step % 4 == 3:
            evicted += tree.evict(12)  # pending backups lock their nodes: what is evictable depends on polls
        digest = {
            "tree": tree_digest(tree),
            "allocator": allocator_digest(alloc),
            "host_allocator": str(tree.host_allocator.available_size()),
        }
        digests.append(digest["tree"])
        try:
            gathered = all_gather_message(group.channel, "digest", StateDigest(digest))
            compare_digests(step, [d.parts for d in gathered])
        except DivergenceError as e:
            report.update(diverged_at=e.step, message=str(e))
            break
    held_back = getattr(agreement, "held_back", 0)
    report.update(
        steps=len(digests),
        digests=digests,
        held_back=held_back,
        evicted=evicted,
        loaded=loaded,
        backups=sum(1 for kind, _, _ in engine.log if kind == "backup"),
    )
    return report


if __name__ == "__main__":
    print(json.dumps(_scenario(sys.argv[1])))
