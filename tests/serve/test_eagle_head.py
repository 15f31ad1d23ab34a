"""EAGLE speculative decoding of a full-attention Llama with an EAGLE head, against Transformers.

The target is a tiny random Llama (Transformers' ``LlamaForCausalLM``, float32); the draft a
separate checkpoint written here as SGLang's ``LlamaForCausalLMEagle`` loads it: ``config.json``
naming that architecture with one layer, random ``fc.weight``/``fc.bias`` and one Llama decoder
layer ``layers.0.*`` without ``input_layernorm``; its embedding and head are the target's. Tokens
are the target's greedy tokens whatever the head proposes, so a random head proves exactness.

* served through the two rounds of ``parity_harness`` (prefix reuse, a multi-turn chat, chunked
  prefill) at page size 1 with a pool small enough to evict and retract, and at page size 16:
  tokens equal Transformers' greedy ``generate``, logits within ``LOGIT_ATOL``, leak-free; the
  small pool again with the ``cpu_tensor`` retraction backup: retracted requests restored (the
  head's pages with the target's; counted, not recomputed) with the same tokens and logits.
* the draft is SGLang's EAGLE head: every round's ``k`` proposals equal those of the head computed
  directly in torch (Transformers' ``LlamaDecoderLayer`` loaded with ``layers.0`` and its input norm
  removed, ``fc`` of the embedding and Transformers' hidden state of the position before, the
  target's head on the un-normed output, the output fed to the next step).
* refusals naming the flag before the cache is built: a head of another hidden size or RoPE base,
  a Llama target's own checkpoint (no head) as the draft; ``python -m kvjax generate
  --speculative-algorithm EAGLE --speculative-draft-model-path HEAD`` gives Transformers' tokens.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvjax.errors import ConfigError
from kvjax.serve.checkpoint import LoadedModel, flatten_params, load_checkpoint
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative.draft_decoding import DraftDecoding
from kvjax.serve.speculative.eagle import EagleDecoding
from kvjax.serve.speculative.nextn import NextNDraftModel, load_nextn_draft, nextn_param_shapes, nextn_tensor_names
from tests.serve.parity_harness import (
    TINY_CONFIG,
    assert_matches_transformers,
    hf_greedy,
    random_transformers_model,
    serve_with_eagle_draft,
    torch,
    transformers,
)
from tests.serve.random_workloads import TINY_LAYER_SIZES

LOGIT_ATOL = 1e-4
MAX_NEW = 6
K = 3
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def write_eagle_head(directory: Path, target_dir: Path, model: LoadedModel, *, seed: int = 0, **config: Any) -> None:
    """An EAGLE head checkpoint in ``directory``: the target's ``config.json`` with the head's
    architecture, one layer and ``config``'s changes; random ``fc`` and ``layers.0`` tensors
    (post-attention norm weights 1)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    raw = json.loads((target_dir / "config.json").read_text())
    raw.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1, **config)
    (directory / "config.json").write_text(json.dumps(raw))
    shapes = dict(flatten_params(nextn_param_shapes(model.config)))
    rng = np.random.default_rng(seed)
    tensors = {}
    for path, name in nextn_tensor_names(model.config).items():
        shape = tuple(shapes[path].shape)
        value = np.ones(shape) if name.endswith("norm.weight") else rng.normal(0.0, 0.2, shape)
        tensors[name] = value.astype(np.float32)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@functools.cache
def _checkpoints(root: str) -> tuple[Any, Path, Path]:
    """(Transformers' target, its checkpoint, the EAGLE head's checkpoint)."""
    config = transformers.LlamaConfig(**TINY_CONFIG, **TINY_LAYER_SIZES, num_hidden_layers=2, rope_parameters=ROPE)
    hf = random_transformers_model(config, seed=1)
    target = Path(root) / "target"
    hf.save_pretrained(target)
    head = Path(root) / "head"
    write_eagle_head(head, target, load_checkpoint(target))
    return hf, target, head


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Any, Path, Path]:
    return _checkpoints(str(tmp_path_factory.mktemp("eagle_head")))


def _serve(
    target_dir: Path, head_dir: Path, *, page_size: int, max_total_tokens: int, **config: Any
) -> tuple[Scheduler, dict[str, ServingReq]]:
    model = load_checkpoint(target_dir)
    draft = load_nextn_draft(head_dir, model)
    assert isinstance(draft, NextNDraftModel) and draft.algorithm == "EAGLE"
    return serve_with_eagle_draft(
        model,
        draft.params,
        "EAGLE",
        num_steps=K,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_new=MAX_NEW,
        **config,
    )


def _proposer(sched: Scheduler) -> EagleDecoding:
    assert isinstance(sched.proposer, EagleDecoding)
    return sched.proposer


class _TorchHead:
    """The EAGLE head computed directly in torch: Transformers' ``LlamaDecoderLayer`` with the
    ``layers.0`` tensors and its input norm removed, ``fc``, the target's embedding, rotary
    embedding and head."""

    def __init__(self, hf: Any, directory: Path) -> None:
        from safetensors.torch import load_file
        from transformers.models.llama import modeling_llama as m

        tensors = load_file(str(directory / "model.safetensors"))
        self.hf = hf
        self.layer = m.LlamaDecoderLayer(hf.config, 0).eval()
        self.layer.input_layernorm = torch.nn.Identity()  # EAGLE's first layer has none
        prefix = "layers.0."
        self.layer.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
        self.fc_weight, self.fc_bias = tensors["fc.weight"], tensors["fc.bias"]

    @torch.no_grad()
    def __call__(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [T, vocab], output hidden [T, hidden])`` over ``tokens`` at positions ``0..T-1``."""
        ids = torch.tensor([tokens])
        x = torch.cat([self.hf.model.embed_tokens(ids), hidden[None]], dim=-1) @ self.fc_weight.T + self.fc_bias
        positions = torch.arange(len(tokens))[None]
        rope = self.hf.model.rotary_emb(x, positions)
        t = len(tokens)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.layer(x, position_embeddings=rope, attention_mask=mask, position_ids=positions)
        return self.hf.lm_head(out)[0], out[0]

    @torch.no_grad()
    def proposals(self, sequence: list[int], k: int) -> list[int]:
        """The ``k`` chained proposals of a round whose last token is ``sequence[-1]`` (earlier
        positions fed Transformers' final-normed hidden state of the position before, each later
        proposal the head's own output)."""
        target = self.hf.model(torch.tensor([sequence])).last_hidden_state[0]
        hidden = torch.cat([torch.zeros_like(target[:1]), target[:-1]])
        tokens, out = list(sequence), []
        for _ in range(k):
            logits, own = self(tokens, hidden)
            out.append(int(logits[-1].argmax()))
            tokens.append(out[-1])
            hidden = torch.cat([hidden, own[-1:]])
        return out


def test_reuse_chunked_prefill_eviction_retraction_and_the_heads_own_proposals(checkpoints, monkeypatch):
    hf, target, head = checkpoints
    rounds: list[tuple[list[list[int]], np.ndarray]] = []
    settle = DraftDecoding._settle_round

    def recording(self: Any, s: Any, running: list[ServingReq], kv_len: Any, proposals: Any, *rest: Any) -> Any:
        rounds.append(([list(r.origin_input_ids) + list(r.output_ids) for r in running], np.asarray(proposals)))
        return settle(self, s, running, kv_len, proposals, *rest)

    monkeypatch.setattr(DraftDecoding, "_settle_round", recording)
    sched, done = _serve(target, head, page_size=1, max_total_tokens=64)
    stats = _proposer(sched).stats
    print("Llama random EAGLE head:", _proposer(sched).report())
    assert stats.rounds > 0 and stats.proposed_tokens == K * stats.request_rounds
    assert stats.accepted_tokens < stats.proposed_tokens / 2, stats  # random: most proposals rejected
    assert stats.rolled_back_slots > 0
    assert sched.stats.cached_tokens > 0  # later prompts reuse the tree's prefixes
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    direct = _TorchHead(hf, head)
    checked = 0
    for sequences, proposals in rounds[:6]:
        for row, sequence in enumerate(sequences):
            assert list(proposals[row]) == direct.proposals(sequence, K), (sequence, proposals[row])
            checked += 1
    assert checked >= 6


def test_the_cpu_tensor_backup_restores_the_heads_pages_with_the_targets(checkpoints):
    hf, target, head = checkpoints
    backed = dict(disaggregation_decode_retraction_backup="cpu_tensor")
    sched, done = _serve(target, head, page_size=1, max_total_tokens=64, **backed)
    [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
    backup = ext.retraction
    assert backup.mode == "cpu_tensor" and backup.pool_names == ("kv", "kv_draft")
    assert sched.stats.retractions > 0 and backup.restored > 0 and backup.restored_tokens > 0, "not recomputed"
    assert backup.held == 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_page_16_with_prefix_reuse(checkpoints):
    hf, target, head = checkpoints
    sched, done = _serve(target, head, page_size=16, max_total_tokens=2048)
    assert sched.stats.cached_tokens > 0 and (done["d"].first_cached_tokens or 0) >= 16
    assert _proposer(sched).stats.proposed_tokens > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_heads_that_do_not_fit_are_refused_by_name(checkpoints, tmp_path):
    _, target, head = checkpoints
    model = load_checkpoint(target)
    wide = tmp_path / "wide"
    write_eagle_head(wide, target, model, hidden_size=2 * model.spec.hidden_size)
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*hidden_size"):
        load_nextn_draft(wide, model)
    rope = tmp_path / "rope"
    write_eagle_head(rope, target, model, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*RoPE base"):
        load_nextn_draft(rope, model)
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*LlamaForCausalLMEagle"):
        load_nextn_draft(target, model)  # the target's own checkpoint: no head
    broken = tmp_path / "broken"
    shutil.copytree(head, broken)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["fc.bias"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match="no EAGLE head weights.*fc.bias"):
        load_nextn_draft(broken, model)


def test_generate_with_the_eagle_head_gives_transformers_tokens(checkpoints, capsys):
    from kvjax.cli import main

    hf, target, head = checkpoints
    argv = ["generate", "--model", str(target), "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "1,2,3,4,5,6,7"]
    argv += ["--max-new-tokens", "6", "--ignore-eos", "--page-size", "1", "--json"]
    flags = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(head)]
    assert main([*argv, *flags, "--speculative-num-steps", "2"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["outputs"] == [hf_greedy(hf, p, 6)[0] for p in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7])]
    assert drafted["speculative"]["num_steps"] == 2 and drafted["speculative"]["proposed_tokens"] > 0
    try:  # the target's own checkpoint has neither an MTP layer nor a head: one error line naming the flag
        code = main(["generate", "--model", str(target), "--prompt-ids", "1,2", "--speculative-algorithm", "EAGLE"])
    except SystemExit as e:
        code = int(e.code or 0)
    _, err = capsys.readouterr()
    assert code == 2 and "--speculative-algorithm EAGLE" in err and "LlamaForCausalLMEagle" in err, err
