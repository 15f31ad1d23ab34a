"""EAGLE-style speculative decoding with DeepSeek's MTP (NextN) layer against Transformers.

The target is the tiny DeepSeek-V2 of ``test_parity_deepseek_v2`` (MLA, a dense first layer then
MoE layers) with ``num_nextn_predict_layers: 1``. Transformers' class has no MTP layer, so its
tensors (``model.layers.3.{enorm, hnorm, eh_proj, shared_head.norm}`` and one decoder layer:
MLA + MoE) are added to the saved ``model.safetensors`` here: tokens are the target's greedy
tokens whatever the draft proposes, so any draft weights prove exactness.

* random MTP weights, served through the two rounds of ``parity_harness`` (prefix reuse, a
  multi-turn chat, chunked prefill) at page size 16, and at page size 1 with a pool small enough to
  evict and retract: tokens equal Transformers' greedy ``generate``, logits within ``LOGIT_ATOL``;
  the hidden-state store holds Transformers' final-normed hidden state at every slot the tree serves;
  the same small pool with the ``cpu_tensor`` retraction backup restores retracted requests (the
  MTP layer's pages with the target's; counted, not recomputed) with the same tokens and logits.
* a "repeat" MTP layer (``eh_proj`` takes the hidden state alone, the decoder layer adds nothing):
  its logits are the target's logits at the position before, so each proposal is the round's last
  token exactly when the draft is fed the target's hidden state of the right position (checked
  round by round; this target never repeats a token, so none is accepted).
* a draft made to agree: the target made a bigram model (every attention ``o_proj`` and MLP
  ``down_proj`` zeroed in the checkpoint, Transformers' model loaded from it) and an MTP layer that
  passes the normed embedding alone and adds nothing: it computes the target's next-token
  function, so the rounds accept (nearly) every proposal, and tokens and logits still equal
  Transformers'.
* refusals, naming the flag, before anything is allocated: ``topk`` above 1, a checkpoint without
  MTP weights, a draft whose vocabulary or hidden size is not the target's.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.errors import ConfigError
from kvjax.serve.checkpoint import LoadedModel, flatten_params, load_checkpoint
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative.draft_decoding import DraftDecoding
from kvjax.serve.speculative.eagle import EagleDecoding, eagle_scheduler
from kvjax.serve.speculative.nextn import nextn_param_shapes, nextn_params, nextn_tensor_names
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    TINY_CONFIG,
    assert_matches_transformers,
    random_transformers_model,
    serve_two_rounds,
    torch,
    transformers,
)

LOGIT_ATOL = 1e-4
MAX_NEW = 6
K = 3

CONFIG = dict(
    ModelSpec.preset("deepseek-tiny").extra,
    **TINY_CONFIG,
    intermediate_size=96,
    num_hidden_layers=3,
    q_lora_rank=24,
    routed_scaling_factor=1.5,
    num_nextn_predict_layers=1,
)


def _silent(name: str) -> bool:
    return name.endswith("o_proj.weight") or name.endswith("down_proj.weight")


def add_mtp_layer(
    directory: Path, model: LoadedModel, *, repeat: bool = False, bigram: bool = False, seed: int = 0
) -> None:
    """Write the MTP layer's tensors into ``directory``'s ``model.safetensors``: random (norms 1),
    or the "repeat" layer, or (``bigram``) the embedding layer with the target's layers silenced
    (module docstring)."""
    from safetensors.numpy import load_file, save_file

    shapes = dict(flatten_params(nextn_param_shapes(model.config)))
    rng = np.random.default_rng(seed)
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    hidden = model.config.hidden_size
    if bigram:
        tensors = {name: np.zeros_like(t) if _silent(name) else t for name, t in tensors.items()}
    for path, name in nextn_tensor_names(model.config).items():
        shape = tuple(shapes[path].shape)
        value = np.ones(shape) if name.endswith("norm.weight") else rng.normal(0.0, 0.2, shape)
        if (repeat or bigram) and name.endswith("eh_proj.weight"):
            halves = [np.eye(hidden), np.zeros((hidden, hidden))]
            value = np.concatenate(halves[::-1] if repeat else halves, axis=1)
        if (repeat or bigram) and _silent(name):
            value = np.zeros(shape)
        tensors[name] = value.astype(np.float32)
    save_file(tensors, str(file), metadata={"format": "pt"})


@functools.cache
def _checkpoints(root: str) -> tuple[Any, Path, Path, Path, Path]:
    """(Transformers' target, its checkpoint without MTP weights, with random ones, with the repeat
    layer, the bigram target's with the embedding layer)."""
    hf = random_transformers_model(transformers.DeepseekV2Config(**CONFIG))
    plain = Path(root) / "plain"
    hf.save_pretrained(plain)
    assert json.loads((plain / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = load_checkpoint(plain)
    dirs = []
    for name in ("random", "repeat", "bigram"):
        directory = Path(root) / name
        shutil.copytree(plain, directory)
        add_mtp_layer(directory, model, repeat=name == "repeat", bigram=name == "bigram")
        dirs.append(directory)
    return hf, plain, dirs[0], dirs[1], dirs[2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Any, Path, Path, Path, Path]:
    return _checkpoints(str(tmp_path_factory.mktemp("deepseek_mtp")))


@pytest.fixture(scope="module")
def deepseek(checkpoints) -> tuple[Any, Path, Path, Path]:
    """(Transformers' target, its checkpoint without MTP weights, with random ones, with the repeat layer)."""
    return checkpoints[:4]


@pytest.fixture(scope="module")
def bigram(checkpoints) -> tuple[Any, Path]:
    """(Transformers' bigram target loaded from its checkpoint, the checkpoint with the embedding MTP layer)."""
    directory = checkpoints[4]
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return hf, directory


def nextn_config(**changes: Any) -> CacheConfig:
    """The parity rounds' cache (context, chunks, 8 running requests) planned for NEXTN with ``K``
    draft tokens per round; ``changes``: page size, pool size, tiers, tp."""
    return CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        max_running_requests=8,
        speculative_algorithm="NEXTN",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        **changes,
    )


def _cache(model: LoadedModel, *, page_size: int, max_total_tokens: int, **config: Any) -> Any:
    return build_kv_cache(model.spec, nextn_config(page_size=page_size, max_total_tokens=max_total_tokens, **config))


def _serve(
    directory: Path, *, page_size: int, max_total_tokens: int, **config: Any
) -> tuple[Scheduler, dict[str, ServingReq]]:
    model = load_checkpoint(directory)
    draft = nextn_params(model.config, model.params, directory)
    sched = eagle_scheduler(
        model.config,
        _cache(model, page_size=page_size, max_total_tokens=max_total_tokens, **config),
        model.params,
        draft_params=draft,
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    done = serve_two_rounds(sched, MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    return sched, done


def _proposer(sched: Scheduler) -> EagleDecoding:
    assert isinstance(sched.proposer, EagleDecoding)
    return sched.proposer


def test_page_16_with_prefix_reuse_multi_turn_and_chunked_prefill(deepseek):
    hf, _, directory, _ = deepseek
    sched, done = _serve(directory, page_size=16, max_total_tokens=2048)
    assert sched.stats.cached_tokens > 0 and (done["d"].first_cached_tokens or 0) >= 16
    stats = _proposer(sched).stats
    assert stats.rounds > 0 and stats.proposed_tokens == K * stats.request_rounds
    print("random MTP layer:", _proposer(sched).report())
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    # the store holds the target's final-normed hidden state at every slot the tree serves
    req = done["chat2"]
    tokens = list(req.origin_input_ids) + req.output_ids[:-1]
    slots = np.asarray(sched.cache.tree_cache.match_prefix(tokens).indices)
    assert len(slots) >= 16
    with torch.no_grad():
        want = hf.model(torch.tensor([tokens])).last_hidden_state[0, : len(slots)].numpy()
    store = np.asarray(_proposer(sched).hidden)
    np.testing.assert_allclose(store[slots], want, atol=1e-4, rtol=0)


def test_page_1_with_a_pool_small_enough_to_evict_and_retract(deepseek):
    hf, _, directory, _ = deepseek
    sched, done = _serve(directory, page_size=1, max_total_tokens=64)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert _proposer(sched).stats.rolled_back_slots > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_the_cpu_tensor_backup_restores_the_mtp_layers_pages_with_the_targets(deepseek):
    hf, _, directory, _ = deepseek
    sched, done = _serve(
        directory, page_size=1, max_total_tokens=64, disaggregation_decode_retraction_backup="cpu_tensor"
    )
    [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
    backup = ext.retraction
    assert backup.mode == "cpu_tensor" and backup.pool_names == ("kv", "kv_draft")
    assert sched.stats.retractions > 0 and backup.restored > 0 and backup.restored_tokens > 0, "not recomputed"
    assert backup.held == 0 and sched.leak_free()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_the_draft_reads_the_targets_hidden_state_of_the_position_before(deepseek, monkeypatch):
    hf, _, _, directory = deepseek
    rounds: list[tuple[list[int], np.ndarray]] = []
    settle = DraftDecoding._settle_round

    def recording(self: Any, s: Any, running: list[ServingReq], kv_len: Any, proposals: Any, *rest: Any) -> Any:
        rounds.append(([r.output_ids[-1] for r in running], np.asarray(proposals)))
        return settle(self, s, running, kv_len, proposals, *rest)

    monkeypatch.setattr(DraftDecoding, "_settle_round", recording)
    sched, done = _serve(directory, page_size=16, max_total_tokens=2048)
    assert rounds
    for last, proposals in rounds:  # the repeat layer proposes the round's last token, k times
        np.testing.assert_array_equal(proposals, np.repeat(np.asarray(last)[:, None], K, axis=1))
    print("repeat MTP layer:", _proposer(sched).report())
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_a_draft_made_to_agree_is_accepted(bigram):
    hf, directory = bigram
    sched, done = _serve(directory, page_size=16, max_total_tokens=2048)
    stats = _proposer(sched).stats
    print("embedding MTP layer, bigram target:", _proposer(sched).report())
    # every round accepts all k; fewer tokens only at a request's end (MAX_NEW)
    assert stats.acceptance_rate >= 0.9 and stats.accept_length >= 2.5, stats
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_refusals_name_the_flag(deepseek):
    _, plain, directory, _ = deepseek
    model = load_checkpoint(plain)
    with pytest.raises(ConfigError, match="speculative_eagle_topk"):
        EagleDecoding({}, K, topk=4)
    with pytest.raises(ConfigError, match="speculative_algorithm.*no MTP layer weights"):
        nextn_params(model.config, model.params, plain)
    draft = nextn_params(model.config, model.params, directory)
    cache = _cache(model, page_size=16, max_total_tokens=256)
    narrow = dict(draft, embed_tokens={"weight": draft["embed_tokens"]["weight"][:100]})
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*vocab"):
        eagle_scheduler(model.config, cache, model.params, draft_params=narrow, num_steps=K)
    thin = dict(draft, eh_proj={"weight": draft["eh_proj"]["weight"][:, :40]})
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*hidden"):
        eagle_scheduler(model.config, cache, model.params, draft_params=thin, num_steps=K)
    without = ModelSpec.from_hf_config(dict(CONFIG, num_nextn_predict_layers=0), name="no-mtp")
    with pytest.raises(ConfigError, match="speculative_algorithm.*no MTP layers"):
        build_kv_cache(without, CacheConfig(context_length=64, speculative_algorithm="NEXTN"))


def test_generate_with_the_mtp_layer_gives_the_plain_tokens(deepseek, capsys):
    from kvjax.cli import main

    _, plain, directory, _ = deepseek
    argv = ["generate", "--model", str(directory), "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "1,2,3,4,5,6,7"]
    argv += ["--max-new-tokens", "6", "--ignore-eos", "--page-size", "1", "--json"]
    assert main(argv) == 0
    alone = json.loads(capsys.readouterr().out)
    flags = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1"]
    assert main([*argv, *flags, "--speculative-num-draft-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    drafted = json.loads(out)
    assert drafted["outputs"] == alone["outputs"]
    assert drafted["speculative"]["num_steps"] == 2 and drafted["speculative"]["topk"] == 1
    assert "without overlap scheduling" not in err  # the rounds overlap
    assert drafted["speculative"]["overlapped_rounds"] > 0
    # the checkpoint's config says one MTP layer, its weights have none: one error line naming it
    try:
        code = main(["generate", "--model", str(plain), "--prompt-ids", "1,2", "--speculative-algorithm", "EAGLE"])
    except SystemExit as e:
        code = int(e.code or 0)
    _, err = capsys.readouterr()
    assert code == 2 and "--speculative-algorithm EAGLE" in err and "no MTP layer weights" in err, err
