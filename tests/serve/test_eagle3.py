"""EAGLE3 speculative decoding of a full-attention Llama with an EAGLE3 draft, against Transformers.

The target is a tiny random Llama of four layers (Transformers' ``LlamaForCausalLM``, float32); the
draft a separate checkpoint written here in the names SGLang's ``LlamaForCausalLMEagle3`` loads:
``config.json`` naming that architecture with one layer, its own ``intermediate_size``, a
``draft_vocab_size`` of 48 of the target's 128 tokens and ``eagle_config`` capturing layers
0, 1 and 2 (boundaries 1, 2, 3); random ``fc.weight`` ``[64, 3 * 64]``, ``midlayer.*`` (q/k/v over
``2 * 64``; norm weights drawn around 1, so each norm is proven in its place), ``norm.weight``,
``lm_head.weight`` ``[48, 64]``, ``d2t`` (a random 48-token subset of the target's vocabulary) and
``t2d``. Tokens are the target's greedy tokens whatever the draft proposes, so a random draft
proves exactness.

* served through the two rounds of ``parity_harness`` (prefix reuse, a multi-turn chat, chunked
  prefill) at page size 1 with a pool small enough to evict and retract: tokens equal
  Transformers' greedy ``generate``, logits within ``LOGIT_ATOL``, leak-free; again with the
  ``cpu_tensor`` retraction backup (the draft's pages restored with the target's, not recomputed);
* the draft is SGLang's EAGLE3: every round's ``k`` proposals equal those of the draft computed
  directly in torch from the checkpoint's tensors (Transformers' hidden states of layers 0, 1, 2
  concatenated and projected by ``fc``, the draft layer written out, its argmax mapped by ``d2t``,
  its un-normed output fed to the next step), and are all in the draft's vocabulary;
* gpt-oss (sliding, full, sliding, full; window 8) with a draft listing layers 2, 0, 1 (captured
  in layer order): the same through its hybrid sliding-window pools, the draft's full-attention
  layer over ``kv_draft``;
* page size 16 with prefix reuse; the capture rule (SGLang's default ``(2, L // 2, L - 3)``, the
  listed layers in layer order, gpt-oss's boundaries) and its refusals (outside the target, a
  boundary named twice);
* refusals naming the path before the cache is built: a draft of another hidden size, of another
  vocabulary, a ``draft_vocab_size`` above it, layers outside the target, a ``d2t`` outside the
  target's vocabulary, a missing tensor, a checkpoint that is not an EAGLE3 draft; ``python -m
  kvjax generate --speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT`` gives
  Transformers' tokens, and with ``--tp 2`` is one error line.
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
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative.draft_decoding import DraftDecoding
from kvjax.serve.speculative.eagle import EagleDecoding
from kvjax.serve.speculative.eagle3_checkpoint import load_eagle3_draft
from kvjax.serve.speculative.eagle3_draft import capture_boundaries
from tests.serve.parity_harness import (
    TINY_CONFIG,
    VOCAB,
    assert_matches_transformers,
    hf_greedy,
    random_transformers_model,
    serve_with_eagle_draft,
    torch,
    transformers,
)
from tests.serve.random_workloads import TINY_LAYER_SIZES
from tests.serve.test_parity_gpt_oss import CONFIG as GPT_OSS_CONFIG

LOGIT_ATOL = 1e-4
MAX_NEW = 6
GPT_OSS_NEW = 12  # past the window of 8 from every prompt
K = 3
LAYERS = 4
CAPTURED = (0, 1, 2)  # eagle_aux_hidden_state_layer_ids: the outputs of these layers
DRAFT_VOCAB = 48
DRAFT_INTERMEDIATE = 96
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def write_eagle3_draft(directory: Path, target_dir: Path, *, seed: int = 0, **config: Any) -> None:
    """An EAGLE3 draft checkpoint in ``directory`` for the target in ``target_dir`` (module
    docstring), ``config``'s keys changed in its ``config.json``."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    raw = json.loads((target_dir / "config.json").read_text())
    raw.update(
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        intermediate_size=DRAFT_INTERMEDIATE,
        draft_vocab_size=DRAFT_VOCAB,
        tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(CAPTURED), "use_aux_hidden_state": True},
    )
    raw.update(config)
    (directory / "config.json").write_text(json.dumps(raw))
    rng = np.random.default_rng(seed)
    h, heads, kv, hd = raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    vocab, draft_vocab = raw["vocab_size"], raw["draft_vocab_size"]
    inter = raw["intermediate_size"]

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, shape).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.2, (h,))).astype(np.float32)

    hot = np.resize(np.sort(rng.choice(vocab, min(draft_vocab, vocab), replace=False)), draft_vocab)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[hot] = True
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": norm(),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": (hot - np.arange(draft_vocab)).astype(np.int64),
        "t2d": t2d,
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@functools.cache
def _checkpoints(root: str) -> tuple[Any, Path, Path]:
    """(Transformers' target, its checkpoint, the EAGLE3 draft's checkpoint)."""
    config = transformers.LlamaConfig(**TINY_CONFIG, **TINY_LAYER_SIZES, num_hidden_layers=LAYERS, rope_parameters=ROPE)
    hf = random_transformers_model(config, seed=1)
    target = Path(root) / "target"
    hf.save_pretrained(target)
    draft = Path(root) / "draft"
    write_eagle3_draft(draft, target)
    return hf, target, draft


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Any, Path, Path]:
    return _checkpoints(str(tmp_path_factory.mktemp("eagle3")))


@functools.cache
def _gpt_oss_checkpoints(root: str) -> tuple[Any, Path, Path]:
    """(Transformers' gpt-oss target, its checkpoint, an EAGLE3 draft's checkpoint listing layers
    2, 0, 1: boundaries 1, 2, 3, captured in layer order)."""
    hf = random_transformers_model(transformers.GptOssConfig(**GPT_OSS_CONFIG), seed=1)
    target = Path(root) / "target"
    hf.save_pretrained(target)
    draft = Path(root) / "draft"
    layers = {"eagle_aux_hidden_state_layer_ids": [2, 0, 1]}
    write_eagle3_draft(draft, target, seed=2, eagle_config=layers, rope_parameters=ROPE, attention_bias=False)
    return hf, target, draft


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Any, Path, Path]:
    return _gpt_oss_checkpoints(str(tmp_path_factory.mktemp("eagle3_gpt_oss")))


def _serve(
    target_dir: Path,
    draft_dir: Path,
    *,
    page_size: int,
    max_total_tokens: int,
    capture: tuple[int, ...] = tuple(i + 1 for i in CAPTURED),
    max_new: int = MAX_NEW,
    **config: Any,
) -> tuple[Scheduler, dict[str, ServingReq]]:
    model = load_checkpoint(target_dir)
    draft = load_eagle3_draft(draft_dir, model)
    assert draft.algorithm == "EAGLE3" and draft.eagle3 is not None
    assert draft.eagle3.capture == capture and draft.eagle3.layer.vocab_size == DRAFT_VOCAB
    return serve_with_eagle_draft(
        model,
        draft.params,
        "EAGLE3",
        num_steps=K,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_new=max_new,
        scheduler_extra={"eagle3": draft.eagle3},
        **config,
    )


def _proposer(sched: Scheduler) -> EagleDecoding:
    assert isinstance(sched.proposer, EagleDecoding)
    return sched.proposer


def _rms(x: Any, weight: Any, eps: float) -> Any:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class _TorchEagle3:
    """The EAGLE3 draft computed directly in torch from the checkpoint's tensors (SGLang's
    ``llama_eagle3.py`` written out), with the target's embedding and rotary embedding."""

    def __init__(self, hf: Any, directory: Path) -> None:
        from safetensors.torch import load_file

        self.t = load_file(str(directory / "model.safetensors"))
        self.hf = hf
        c = json.loads((directory / "config.json").read_text())
        self.capture = c.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        self.eps, self.hd = c["rms_norm_eps"], c["head_dim"]
        self.heads, self.kv = c["num_attention_heads"], c["num_key_value_heads"]
        theta = c["rope_parameters"]["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd)

    def project(self, aux: Any) -> Any:
        return aux @ self.t["fc.weight"].T

    @torch.no_grad()
    def __call__(self, tokens: list[int], hidden: Any) -> tuple[Any, Any]:
        """``(logits [T, draft_vocab], output hidden [T, hidden])`` over ``tokens`` at positions
        ``0..T-1``, ``hidden`` the projected state of each position before."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        t, m = len(tokens), self.t
        e = self.hf.model.embed_tokens(torch.tensor(tokens))
        normed_embeds = _rms(e, m["midlayer.input_layernorm.weight"], self.eps)
        x = torch.cat([normed_embeds, _rms(hidden, m["midlayer.hidden_norm.weight"], self.eps)], dim=-1)
        q = (x @ m["midlayer.self_attn.q_proj.weight"].T).view(t, self.heads, self.hd).transpose(0, 1)[None]
        k = (x @ m["midlayer.self_attn.k_proj.weight"].T).view(t, self.kv, self.hd).transpose(0, 1)[None]
        v = (x @ m["midlayer.self_attn.v_proj.weight"].T).view(t, self.kv, self.hd).transpose(0, 1)[None]
        angles = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None]  # the draft's own RoPE
        angles = torch.cat([angles, angles], dim=-1)[None]
        q, k = apply_rotary_pos_emb(q, k, angles.cos(), angles.sin())
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.hd**-0.5 + torch.full((t, t), float("-inf")).triu(1)
        attn = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(t, -1) @ m["midlayer.self_attn.o_proj.weight"].T
        r = hidden + attn
        n = _rms(r, m["midlayer.post_attention_layernorm.weight"], self.eps)
        gate, up = n @ m["midlayer.mlp.gate_proj.weight"].T, n @ m["midlayer.mlp.up_proj.weight"].T
        r = r + (torch.nn.functional.silu(gate) * up) @ m["midlayer.mlp.down_proj.weight"].T
        return _rms(r, m["norm.weight"], self.eps) @ m["lm_head.weight"].T, r

    @torch.no_grad()
    def proposals(self, sequence: list[int], k: int) -> list[int]:
        """The ``k`` chained proposals (target ids) of a round whose last token is
        ``sequence[-1]``: earlier positions fed the projection of Transformers' captured layers at
        the position before (zeros at position 0), each later proposal the draft's own output."""
        states = self.hf.model(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        layers = self.hf.config.num_hidden_layers
        boundaries = sorted({i + 1 for i in self.capture} if self.capture else {2, layers // 2, layers - 3})
        aux = torch.cat([states[b][0] for b in boundaries], dim=-1)  # hidden_states[b]: entering layer b
        projected = self.project(aux)
        hidden = torch.cat([torch.zeros_like(projected[:1]), projected[:-1]])
        tokens, out = list(sequence), []
        d2t = self.t["d2t"]
        for _ in range(k):
            logits, own = self(tokens, hidden)
            draft_id = int(logits[-1].argmax())
            out.append(draft_id + int(d2t[draft_id]))
            tokens.append(out[-1])
            hidden = torch.cat([hidden, own[-1:]])
        return out


def _record_rounds(monkeypatch: Any) -> list[tuple[list[list[int]], np.ndarray]]:
    """Every round's rows (each request's tokens so far) and proposals, as the rounds settle."""
    rounds: list[tuple[list[list[int]], np.ndarray]] = []
    settle = DraftDecoding._settle_round

    def recording(self: Any, s: Any, running: list[ServingReq], kv_len: Any, proposals: Any, *rest: Any) -> Any:
        rounds.append(([list(r.origin_input_ids) + list(r.output_ids) for r in running], np.asarray(proposals)))
        return settle(self, s, running, kv_len, proposals, *rest)

    monkeypatch.setattr(DraftDecoding, "_settle_round", recording)
    return rounds


def _check_rounds(name: str, sched: Scheduler, hf: Any, draft: Path, rounds: list[Any]) -> None:
    """The counters of a random draft (most proposals rejected), printed with the target steps per
    token, and the first rounds' proposals equal to the draft computed in torch."""
    proposer = _proposer(sched)
    stats = proposer.stats
    report = proposer.report()
    steps_per_token = stats.request_rounds / stats.round_tokens  # a row's verify forwards per token it decodes
    print(f"{name} random EAGLE3 draft:", report, f"target steps per decoded token {steps_per_token:.3f}")
    assert report["algorithm"] == "EAGLE3"
    assert stats.rounds > 0 and stats.proposed_tokens == K * stats.request_rounds
    assert stats.accepted_tokens < stats.proposed_tokens / 2, stats  # random: most proposals rejected
    assert stats.rolled_back_slots > 0
    direct = _TorchEagle3(hf, draft)
    hot = set((np.arange(DRAFT_VOCAB) + direct.t["d2t"].numpy()).tolist())
    checked = 0
    for sequences, proposals in rounds[:6]:
        for row, sequence in enumerate(sequences):
            assert set(proposals[row].tolist()) <= hot  # the draft's vocabulary, as target ids
            assert list(proposals[row]) == direct.proposals(sequence, K), (sequence, proposals[row])
            checked += 1
    assert checked >= 6


def test_reuse_chunked_prefill_eviction_retraction_and_the_drafts_own_proposals(checkpoints, monkeypatch):
    hf, target, draft = checkpoints
    rounds = _record_rounds(monkeypatch)
    sched, done = _serve(target, draft, page_size=1, max_total_tokens=64)
    _check_rounds("Llama", sched, hf, draft, rounds)
    assert sched.stats.cached_tokens > 0  # later prompts reuse the tree's prefixes
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_the_cpu_tensor_backup_restores_the_drafts_pages_with_the_targets(checkpoints):
    hf, target, draft = checkpoints
    backed = dict(disaggregation_decode_retraction_backup="cpu_tensor")
    sched, done = _serve(target, draft, page_size=1, max_total_tokens=64, **backed)
    [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
    backup = ext.retraction
    assert backup.mode == "cpu_tensor" and backup.pool_names == ("kv", "kv_draft")
    assert sched.stats.retractions > 0 and backup.restored > 0 and backup.restored_tokens > 0, "not recomputed"
    assert backup.held == 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_gpt_oss_over_its_sliding_window_pools(gpt_oss, monkeypatch):
    """A hybrid sliding-window target (sliding, full, sliding, full; window 8): the draft's one
    full-attention layer over ``kv_draft`` indexed by the allocator's slots, the windows sliding
    past the prompts, eviction and retraction."""
    hf, target, draft = gpt_oss
    rounds = _record_rounds(monkeypatch)
    sched, done = _serve(target, draft, page_size=1, max_total_tokens=64, capture=(1, 2, 3), max_new=GPT_OSS_NEW)
    assert sched.cache.is_hybrid_swa
    _check_rounds("gpt-oss", sched, hf, draft, rounds)
    assert sched.stats.cached_tokens > 0 and sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert_matches_transformers(hf, done, max_new=GPT_OSS_NEW, atol=LOGIT_ATOL)


def test_page_16_with_prefix_reuse(checkpoints):
    hf, target, draft = checkpoints
    sched, done = _serve(target, draft, page_size=16, max_total_tokens=2048)
    assert sched.stats.cached_tokens > 0 and (done["d"].first_cached_tokens or 0) >= 16
    assert _proposer(sched).stats.proposed_tokens > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_the_captured_layers_follow_sglangs_rule():
    assert capture_boundaries("llama", 32, {}, "d") == (2, 16, 29)  # layers 1, 15, 28
    assert capture_boundaries("llama", 8, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 0, 3]}}, "d") == (
        1,
        4,
        6,
    )  # captured in layer order
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*fc reads 3 .* captures 2"):
        capture_boundaries("llama", 4, {}, "d")  # SGLang's default (2, 2, 1): boundary 2 captured once
    named = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert capture_boundaries("llama", 32, named, "d") == (2, 16, 29)
    ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 18, 36]}}
    assert capture_boundaries("gpt_oss", 36, ids, "d") == (1, 18, 36)  # SGLang's gpt-oss: boundaries already
    assert capture_boundaries("llama", 37, ids, "d") == (2, 19, 37)
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*outside the target's 0..2"):
        capture_boundaries("llama", 2, {}, "d")  # SGLang's default needs 3 layers
    with pytest.raises(ConfigError, match="fc reads 2 hidden states"):
        capture_boundaries("llama", 8, {"num_aux_hidden_states": 2}, "d")


def test_drafts_that_do_not_fit_are_refused_by_name(checkpoints, tmp_path):
    _, target, draft = checkpoints
    model = load_checkpoint(target)
    cases = {
        "hidden_size": dict(hidden_size=2 * model.spec.hidden_size),
        "vocab_size": dict(vocab_size=VOCAB * 2),
        "draft_vocab_size": dict(draft_vocab_size=VOCAB + 1),
        "eagle_aux_hidden_state_layer_ids": dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, LAYERS]}),
    }
    for key, change in cases.items():
        bad = tmp_path / key
        write_eagle3_draft(bad, target, **change)
        with pytest.raises(ConfigError, match=f"speculative_draft_model_path.*{bad}.*{key}"):
            load_eagle3_draft(bad, model)
    with pytest.raises(ConfigError, match="speculative_draft_model_path.*LlamaForCausalLMEagle3"):
        load_eagle3_draft(target, model)  # the target's own checkpoint: no EAGLE3 draft
    from safetensors.numpy import load_file, save_file

    for name, broken_value in (("midlayer.hidden_norm.weight", None), ("d2t", np.full(DRAFT_VOCAB, VOCAB))):
        broken = tmp_path / f"broken_{name}"
        shutil.copytree(draft, broken)
        tensors = load_file(str(broken / "model.safetensors"))
        if broken_value is None:
            del tensors[name]
        else:
            tensors[name] = broken_value
        save_file(tensors, str(broken / "model.safetensors"))
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
            load_eagle3_draft(broken, model)


def test_generate_with_the_eagle3_draft_gives_transformers_tokens(checkpoints, capsys):
    from kvjax.cli import main

    hf, target, draft = checkpoints
    argv = ["generate", "--model", str(target), "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "1,2,3,4,5,6,7"]
    argv += ["--max-new-tokens", "6", "--ignore-eos", "--page-size", "1", "--json"]
    flags = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft)]
    assert main([*argv, *flags, "--speculative-num-steps", "2"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["outputs"] == [hf_greedy(hf, p, 6)[0] for p in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7])]
    assert drafted["speculative"]["algorithm"] == "EAGLE3" and drafted["speculative"]["proposed_tokens"] > 0
    try:  # the target's own checkpoint is no EAGLE3 draft: one error line naming the flag
        code = main([*argv, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(target)])
    except SystemExit as e:
        code = int(e.code or 0)
    _, err = capsys.readouterr()
    assert code == 2 and "--speculative-draft-model-path" in err and "LlamaForCausalLMEagle3" in err, err
    try:  # several devices: one error line naming both flags, before jax
        code = main([*argv, *flags, "--tp", "2"])
    except SystemExit as e:
        code = int(e.code or 0)
    _, err = capsys.readouterr()
    assert code == 2 and "--speculative-algorithm EAGLE3 with --tp 2" in err, err
