"""Retention in the serving loop (issue 37, item 3's proof): a served system prompt whose request
asked for ``retention_seconds`` survives a flood of unrelated prompts that evicts it without
retention, and once the retention expires the flood evicts it.

The tiny model on a small pool (256 tokens): a request with a 64-token system prompt is served,
then a flood of unrelated prompts (several pools' worth of tokens), then a probe with the same
system prompt and a new question. With retention the probe's prompt hits the whole system prompt;
without, it misses. The tokens of every request are the same either way (retention changes only
what is evicted). The scheduler's retention clock is a callable the test advances by hand.
``generate --retention-seconds`` does the same from the command line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax import ModelSpec
from kvjax.demo import demo_cache
from kvjax.multihost.agreement import LocalAgreement
from kvjax.serve.model import init_params
from kvjax.serve.retention_clock import RetentionClock
from kvjax.serve.scheduler import Scheduler, ServingReq

SYSTEM = 64
POOL = 256
FLOOD = 12  # prompts of 40 tokens: ~2 pools' worth with their outputs
NEW = 4
RETAIN = 60.0


class _Clock:
    """A retention clock advanced by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _prompts(seed: int = 3) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """The system prompt (tokens < 100), two questions after it, and two floods of unrelated
    prompts (tokens >= 100: they share no page with the system prompt)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 100, SYSTEM).tolist()
    questions = [[200 + i, 201 + i, 202 + i, 203 + i] for i in range(3)]
    floods = [[rng.integers(100, 256, 40).tolist() for _ in range(FLOOD)] for _ in range(2)]
    return system, questions, floods


def _serve(page_size: int, retention: float | None) -> tuple[Scheduler, _Clock, dict[str, ServingReq]]:
    spec = ModelSpec.preset("tiny")
    cache = demo_cache(page_size=page_size, max_total_tokens=POOL, chunked_prefill_size=128)
    clock = _Clock()
    sched = Scheduler(spec, cache, init_params(spec), max_batch_size=2, chunked_prefill_size=128, retention_clock=clock)
    system, questions, floods = _prompts()
    done: dict[str, ServingReq] = {}

    def run(reqs: list[ServingReq]) -> None:
        for req in sched.run(reqs):
            done[req.rid] = req

    run([ServingReq("system", system + questions[0], max_new_tokens=NEW, priority=1, retention_seconds=retention)])
    run([ServingReq(f"flood{i}", p, max_new_tokens=NEW) for i, p in enumerate(floods[0])])
    run([ServingReq("probe", system + questions[1], max_new_tokens=NEW)])
    clock.now += RETAIN + 1  # the retention expired
    run([ServingReq(f"late{i}", p, max_new_tokens=NEW) for i, p in enumerate(floods[1])])
    run([ServingReq("late-probe", system + questions[2], max_new_tokens=NEW)])
    assert sched.leak_free()
    sched.tree.sanity_check()
    return sched, clock, done


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_retained_system_prompt_survives_a_flood_that_evicts_it_without_retention(page_size):
    kept, clock, with_retention = _serve(page_size, RETAIN)
    plain, _, without = _serve(page_size, None)
    # The same tokens for every request: retention changes only what is evicted.
    assert {r: q.output_ids for r, q in with_retention.items()} == {r: q.output_ids for r, q in without.items()}
    assert kept.stats.evicted_tokens > POOL and plain.stats.evicted_tokens > POOL  # the floods evict
    # The probe: the whole system prompt hit with retention, a miss without.
    assert with_retention["probe"].first_cached_tokens == SYSTEM
    assert without["probe"].first_cached_tokens == 0
    # After the retention expired, the second flood evicted it.
    assert with_retention["late-probe"].first_cached_tokens == 0
    # The clock was read once per step (a step that only resolves reads it too) and given to
    # the tree; a run where no request asked for retention never reads it.
    assert kept.retention_clock.readings >= kept.stats.prefill_steps + kept.stats.decode_steps
    assert kept.tree.retention_now == clock.now
    assert plain.retention_clock.readings == 0


def test_no_request_with_retention_reads_no_clock():
    spec = ModelSpec.preset("tiny")
    clock = _Clock()
    sched = Scheduler(spec, demo_cache(max_total_tokens=POOL), init_params(spec), retention_clock=clock)
    sched.run([ServingReq("a", [1, 2, 3, 4], max_new_tokens=2, priority=3)])
    assert sched.retention_clock.readings == 0 and sched.tree.retention_now == 0.0


class _MinOverTwo:
    """An agreement of two processes whose other process's clock reads ``other`` seconds."""

    is_local = False

    def __init__(self, other: float) -> None:
        self.other = other
        self.tags: list[str] = []

    def agree_min(self, tag: str, values):
        self.tags.append(tag)
        return [min(int(v), int(self.other * 1_000_000)) for v in values]


def test_the_clock_is_agreed_as_the_minimum_over_the_processes():
    agreement = _MinOverTwo(other=12.5)
    clock = RetentionClock(lambda: 20.0, agreement)
    assert clock.read() == 12.5 and agreement.tags == ["retention_clock"]
    assert RetentionClock(lambda: 20.25, LocalAgreement()).read() == 20.25
    with pytest.raises(ValueError, match="retention clock reading=nan"):
        RetentionClock(lambda: float("nan")).read()
    with pytest.raises(ValueError, match="retention clock 5"):
        RetentionClock(5)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1.0, float("inf"), "10"])
def test_a_serving_request_with_bad_retention_is_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match=f"request 'r': retention_seconds={bad!r}"):
        ServingReq("r", [1, 2, 3], max_new_tokens=2, retention_seconds=bad)


def _generate_cached_tokens(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, list[list[int]]]:
    """``generate --json`` on the tiny model: a 48-token system prompt with a question, four
    unrelated prompts that fill the 160-token pool, then the system prompt with another question,
    one request at a time; returns (cached prompt tokens, outputs)."""
    from kvjax.cli import main

    rng = np.random.default_rng(7)
    system = rng.integers(0, 100, 48).tolist()
    prompts = [system + [200, 201]] + [rng.integers(100, 256, 48).tolist() for _ in range(4)] + [system + [210, 211]]
    argv = ["generate", "--model", "tiny", "--max-new-tokens", "4", "--ignore-eos", "--json"]
    argv += ["--max-total-tokens", "160", "--page-size", "16", "--max-batch-size", "1", *flags]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    return report["cached_tokens"], report["outputs"]


def test_generate_retention_seconds_keeps_the_first_prompts_prefix(capsys):
    keep = ["--retention-seconds", "600", *["--retention-seconds", "0"] * 5, "--priority", "1"]
    cached, outputs = _generate_cached_tokens(capsys, *keep)
    plain_cached, plain_outputs = _generate_cached_tokens(capsys)
    assert outputs == plain_outputs
    assert (cached, plain_cached) == (48, 0)  # the last prompt hit the retained system prompt's 3 pages


def test_retention_never_blocks_an_allocation_when_every_prefix_is_retained():
    """Every request retained for longer than the run, in a pool that holds a few of them: the
    scheduler evicts retained prefixes when nothing else is left (no deadlock, no refused
    allocation, no retraction that eviction could have spared), with the same tokens."""
    _, _, floods = _prompts()
    outputs = []
    for retention in (1e6, None):
        spec = ModelSpec.preset("tiny")
        sched = Scheduler(spec, demo_cache(page_size=16, max_total_tokens=POOL), init_params(spec), max_batch_size=2)
        reqs = [
            ServingReq(f"r{i}", p, max_new_tokens=NEW, priority=i % 3, retention_seconds=retention)
            for i, p in enumerate(floods[0] + floods[1])
        ]
        done = sched.run(reqs)
        assert len(done) == len(reqs) and sched.leak_free()
        assert sched.stats.evicted_tokens > POOL
        sched.tree.sanity_check()
        outputs.append(({r.rid: r.output_ids for r in done}, sched.stats.retractions))
        if retention:
            retained = [n for n in sched.tree.nodes() if n.retain_until > sched.tree.retention_now]
            assert retained and sched.tree.total_size() <= POOL
    assert outputs[0] == outputs[1]  # the same tokens and the same retractions as without retention
