"""EAGLE-style speculative decoding over pipeline stages, against Hugging Face Transformers.

The target runs over 2 stages (of 1 device, or of 2 TP devices), its draft on the last stage
(``kvjax.serve.pipeline_eagle``): the tiny DeepSeek-V2 of ``tests/serve/test_speculative_eagle.py``
with its NextN (MTP) layer, the tiny Llama with an EAGLE head of ``tests/serve/test_eagle_head.py``
and the tiny Qwen3-Next with its MTP layer of ``tests/serve/test_qwen3_next_mtp.py`` (recurrent
state: the rounds' state restored on every stage and the kept tokens replayed). Each is served
through the two rounds of ``parity_harness`` (prefix reuse, a multi-turn chat, chunked prefill),
on pools small enough to evict and retract where asked: tokens equal Transformers' greedy
``generate``, logits within 1e-4; the one allocator every stage's pools and the draft's pool share
is leak free after, the tree sane; the draft's pool, its weights and the hidden-state store lie on
the last stage's devices only. DeepSeek's "repeat" MTP layer proposes each round's last token,
so the last stage feeds the draft the target's hidden state of the right position, and the store
holds Transformers' hidden states. Random drafts prove exactness (tokens are the target's whatever is
proposed); DeepSeek's bigram target with an MTP layer made to agree accepts nearly every proposal,
so the rounds' acceptance and rollback run over the stages too. ``python -m kvjax generate --pp 2
--speculative-algorithm NEXTN`` gives the plain tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from kvjax import CacheConfig
from kvjax.errors import ConfigError
from kvjax.pipeline_check import check_pipeline_config
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.pipeline_cache import build_pipeline_cache
from kvjax.serve.pipeline_eagle import PipelineEagleDecoding, pipeline_eagle_scheduler
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative.draft_decoding import DraftDecoding
from kvjax.serve.speculative.nextn import load_nextn_draft, nextn_params
from tests.serve import test_eagle_head, test_qwen3_next_mtp
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    assert_matches_transformers,
    serve_two_rounds,
    torch,
    transformers,
)
from tests.serve.test_speculative_eagle import _checkpoints as deepseek_checkpoints
from tests.serve.test_speculative_eagle import nextn_config

pytestmark = pytest.mark.mesh

K = 3
MAX_NEW = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[Any, ...]:
    return deepseek_checkpoints(str(tmp_path_factory.mktemp("deepseek_mtp")))


def _serve(
    directory: Path,
    draft_params: Any,
    pp: int,
    tp: int,
    *,
    micro_batches: int = 1,
    overlap: bool = False,
    **cache: Any,
) -> tuple[Scheduler, dict[str, ServingReq]]:
    model = load_checkpoint(directory)
    config = nextn_config(pp_size=pp, tp_size=tp, **cache)
    pipeline = build_pipeline_cache(model.spec, config, devices=jax.devices())
    sched = pipeline_eagle_scheduler(
        model.config,
        pipeline,
        model.params,
        draft_params=draft_params,
        num_steps=K,
        micro_batches=micro_batches,
        overlap=overlap,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    _assert_draft_on_the_last_stage(sched)
    done = serve_two_rounds(sched, MAX_NEW)  # asserts the one allocator leak free
    sched.cache.tree_cache.sanity_check()
    proposer = _proposer(sched)
    print(f"pp {pp} x tp {tp}, {model.config.family}:", proposer.report())
    assert proposer.stats.rounds > 0 and proposer.stats.proposed_tokens == K * proposer.stats.request_rounds
    return sched, done


def _proposer(sched: Scheduler) -> PipelineEagleDecoding:
    assert isinstance(sched.proposer, PipelineEagleDecoding)
    return sched.proposer


def _assert_draft_on_the_last_stage(sched: Scheduler) -> None:
    proposer = _proposer(sched)
    pipe = proposer.pipeline
    last = pipe.pp_size - 1
    devices = set(pipe.meshes[last].devices.flat)
    assert "kv_draft" in pipe.pools(last) and all("kv_draft" not in pipe.pools(s) for s in range(last))
    assert proposer.hidden is not None and proposer.hidden.sharding.device_set == devices
    for leaf in jax.tree.leaves(proposer.draft_params) + jax.tree.leaves(pipe.pools(last)["kv_draft"]):
        assert leaf.sharding.device_set == devices, "the draft off the last stage"


@pytest.mark.parametrize(
    ("pp", "tp", "micro_batches", "overlap", "cache"),
    [
        (2, 1, 2, True, dict(page_size=16, max_total_tokens=2048)),
        (2, 1, 1, False, dict(page_size=1, max_total_tokens=64)),
        (2, 2, 2, False, dict(page_size=1, max_total_tokens=64, disaggregation_decode_retraction_backup="cpu_tensor")),
    ],
    ids=["pp2-page16-reuse", "pp2-page1-evict-retract", "pp2xtp2-page1-cpu-tensor-backup"],
)
def test_deepseek_nextn_over_stages(deepseek, pp, tp, micro_batches, overlap, cache):
    hf, _, directory, _, _ = deepseek
    model = load_checkpoint(directory)
    draft = nextn_params(model.config, model.params, directory)
    sched, done = _serve(directory, draft, pp, tp, micro_batches=micro_batches, overlap=overlap, **cache)
    assert sched.stats.cached_tokens > 0
    if cache["page_size"] == 1:
        assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
        assert _proposer(sched).stats.rolled_back_slots > 0
    if "disaggregation_decode_retraction_backup" in cache:
        [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
        assert "kv_draft" in ext.retraction.pool_names and ext.retraction.restored > 0, "not restored"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_deepseek_a_draft_made_to_agree_is_accepted_over_stages(deepseek):
    directory = deepseek[4]
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = load_checkpoint(directory)
    draft = nextn_params(model.config, model.params, directory)
    sched, done = _serve(directory, draft, 2, 1, page_size=1, max_total_tokens=2048)
    stats = _proposer(sched).stats
    assert stats.acceptance_rate >= 0.9 and stats.accept_length >= 2.5, stats
    assert stats.rolled_back_slots > 0  # the accepted tokens cut at the requests' ends, rolled back
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_the_draft_reads_the_targets_hidden_state_of_the_position_before_over_stages(deepseek, monkeypatch):
    """The "repeat" MTP layer proposes the round's last token exactly when the last stage feeds it
    the target's hidden state of the position before (``test_speculative_eagle``'s check), and the
    store holds Transformers' final-normed hidden state at every slot the tree serves."""
    hf, _, _, directory, _ = deepseek
    rounds: list[tuple[list[int], np.ndarray]] = []
    settle = DraftDecoding._settle_round

    def recording(self: Any, s: Any, running: list[ServingReq], kv_len: Any, proposals: Any, *rest: Any) -> Any:
        rounds.append(([r.output_ids[-1] for r in running], np.asarray(proposals)))
        return settle(self, s, running, kv_len, proposals, *rest)

    monkeypatch.setattr(DraftDecoding, "_settle_round", recording)
    model = load_checkpoint(directory)
    draft = nextn_params(model.config, model.params, directory)
    sched, done = _serve(directory, draft, 2, 1, page_size=16, max_total_tokens=2048)
    assert rounds
    for last, proposals in rounds:
        np.testing.assert_array_equal(proposals, np.repeat(np.asarray(last)[:, None], K, axis=1))
    req = done["chat2"]
    tokens = list(req.origin_input_ids) + req.output_ids[:-1]
    slots = np.asarray(sched.cache.tree_cache.match_prefix(tokens).indices)
    assert len(slots) >= 16
    with torch.no_grad():
        want = hf.model(torch.tensor([tokens])).last_hidden_state[0, : len(slots)].numpy()
    np.testing.assert_allclose(np.asarray(_proposer(sched).hidden)[slots], want, atol=1e-4, rtol=0)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_llama_eagle_head_over_stages(tmp_path_factory):
    hf, target, head = test_eagle_head._checkpoints(str(tmp_path_factory.mktemp("eagle_head")))
    model = load_checkpoint(target)
    draft = load_nextn_draft(head, model)
    config = dict(page_size=1, max_total_tokens=64)
    sched, done = _serve_algorithm(target, draft.params, "EAGLE", **config)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_qwen3_next_mtp_over_stages(tmp_path_factory):
    hf, _, directory = test_qwen3_next_mtp._checkpoints(str(tmp_path_factory.mktemp("qwen3_next_mtp")))
    model = load_checkpoint(directory)
    draft = nextn_params(model.config, model.params, directory)
    sched, done = _serve_algorithm(directory, draft, "NEXTN", page_size=1, max_total_tokens=64)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert _proposer(sched).stats.replayed_requests > 0
    table = sched.cache.req_to_token_pool
    tree = sched.cache.tree_cache
    held = tree.mamba_evictable_size() + tree.mamba_protected_size()  # type: ignore[attr-defined]
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def _serve_algorithm(directory: Path, draft_params: Any, algorithm: str, **cache: Any) -> tuple[Scheduler, dict]:
    model = load_checkpoint(directory)
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        max_running_requests=8,
        speculative_algorithm=algorithm,
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        pp_size=2,
        **cache,
    )
    pipeline = build_pipeline_cache(model.spec, config, devices=jax.devices())
    sched = pipeline_eagle_scheduler(
        model.config,
        pipeline,
        model.params,
        draft_params=draft_params,
        num_steps=K,
        overlap=False,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    _assert_draft_on_the_last_stage(sched)
    done = serve_two_rounds(sched, MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    print(f"pp 2, {model.config.family} ({algorithm}):", _proposer(sched).report())
    return sched, done


def test_refusals_name_the_flag(deepseek):
    _, _, directory, _, _ = deepseek
    model = load_checkpoint(directory)
    pipeline = build_pipeline_cache(model.spec, nextn_config(pp_size=2, page_size=16, max_total_tokens=256))
    draft = nextn_params(model.config, model.params, directory)
    with pytest.raises(ConfigError, match="speculative_eagle_topk"):
        pipeline_eagle_scheduler(model.config, pipeline, model.params, draft_params=draft, num_steps=K, topk=2)
    for algorithm, why in (("STANDALONE", "EAGLE .non-multi-layer. only"), ("EAGLE3", "EAGLE3 draft")):
        with pytest.raises(ConfigError, match=f"speculative_algorithm.*{why}"):
            build_pipeline_cache(model.spec, nextn_config(pp_size=2).replace(speculative_algorithm=algorithm))
    with pytest.raises(ConfigError, match="enable_hierarchical_cache"):
        build_pipeline_cache(model.spec, nextn_config(pp_size=2, enable_hierarchical_cache=True))
    with pytest.raises(ConfigError, match="speculative_algorithm.*DP attention over pipeline stages"):
        check_pipeline_config(model.spec, nextn_config(pp_size=2, dp_size=2, enable_dp_attention=True, tp_size=2))


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--speculative-algorithm", "EAGLE", "--dp", "2", "--tp", "2"], "the draft under DP attention over pipeline"),
        (["--speculative-algorithm", "EAGLE", "--enable-hierarchical-cache"], "the host tier with a draft over"),
    ],
    ids=["dp", "host-tier"],
)
def test_the_command_line_refuses_what_stages_do_not_serve_with_a_draft(deepseek, capsys, flags, says):
    from kvjax.cli import main

    argv = ["generate", "--model", str(deepseek[2]), "--prompt-ids", "1,2,3", "--pp", "2", *flags]
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and f"--pp 2 with --speculative-algorithm {flags[1]}" in err and says in err, err


def test_generate_over_stages_gives_the_plain_tokens(deepseek, capsys):
    from kvjax.cli import main

    directory = deepseek[2]
    argv = ["generate", "--model", str(directory), "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "1,2,3,4,5,6,7"]
    argv += ["--max-new-tokens", "6", "--ignore-eos", "--page-size", "1", "--json"]
    assert main(argv) == 0
    alone = json.loads(capsys.readouterr().out)
    flags = ["--pp", "2", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2"]
    assert main([*argv, *flags, "--speculative-num-draft-tokens", "3"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["outputs"] == alone["outputs"]
    assert drafted["speculative"]["num_steps"] == 2 and drafted["speculative"]["rounds"] > 0
