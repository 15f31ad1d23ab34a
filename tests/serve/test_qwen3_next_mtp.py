"""EAGLE / NEXTN speculative decoding of Qwen3-Next with its own MTP layer, against Transformers.

The target is the tiny Qwen3-Next of ``test_speculative_recurrent`` (3 gated-delta-net layers and one
full-attention layer, float32), its ``config.json`` given ``mtp_num_hidden_layers: 1`` and its
``model.safetensors`` random ``mtp.*`` tensors written here (Transformers' ``Qwen3NextForCausalLM``
ignores them, so the target's tokens and logits are Transformers' whatever the draft proposes). A
random MTP layer rarely agrees with the target: most rounds reject drafts, and the target's
recurrent state is restored and the kept tokens replayed (``state_replay``) on the EAGLE path too.

* served through the two rounds of ``parity_harness`` (prefix reuse, a multi-turn chat, chunked
  prefill) at page size 1 with a roomy pool and with one small enough to evict and retract: tokens
  equal Transformers' greedy ``generate``, logits within ``LOGIT_ATOL``, no KV or state slot leaked.
* the draft is SGLang's MTP layer: every round's ``k`` proposals equal those of the MTP layer
  computed directly in torch (Transformers' own ``Qwen3NextDecoderLayer`` loaded with the
  ``mtp.layers.0`` weights, ``fc`` of the normed embedding and the normed hidden state of the
  position before, the final ``(1 + w)`` norm and the target's head), fed Transformers' hidden states.
* ``python -m kvjax generate --speculative-algorithm NEXTN`` over the checkpoint gives the plain tokens;
  a checkpoint without the ``mtp.*`` tensors is refused by name.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.errors import ConfigError
from kvjax.radix import MambaRadixCache
from kvjax.serve.checkpoint import LoadedModel, flatten_params, load_checkpoint
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
from tests.serve.random_workloads import QWEN3_NEXT_DENSE_MLPS, QWEN3_NEXT_LAYERS, TINY_LAYER_SIZES

LOGIT_ATOL = 2e-4  # the Qwen3-Next parity test's: Transformers' chunked delta rule against the recurrence
MAX_NEW = 6
K = 3
_FULL_LAYER = QWEN3_NEXT_LAYERS["layer_types"].index("full_attention")  # a Transformers layer of the MTP's kind


def add_mtp_layer(directory: Path, model: LoadedModel, *, seed: int = 0) -> None:
    """Write random ``mtp.*`` tensors into ``directory``'s ``model.safetensors`` and
    ``mtp_num_hidden_layers: 1`` into its ``config.json``."""
    from safetensors.numpy import load_file, save_file

    shapes = dict(flatten_params(nextn_param_shapes(model.config)))
    rng = np.random.default_rng(seed)
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    for path, name in nextn_tensor_names(model.config).items():
        tensors[name] = rng.normal(0.0, 0.2, tuple(shapes[path].shape)).astype(np.float32)
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=1)))


@functools.cache
def _checkpoints(root: str) -> tuple[Any, Path, Path]:
    """(Transformers' target, its checkpoint without the MTP layer, with a random one)."""
    config = transformers.Qwen3NextConfig(
        **TINY_CONFIG, **TINY_LAYER_SIZES, **QWEN3_NEXT_LAYERS, **QWEN3_NEXT_DENSE_MLPS
    )
    hf = random_transformers_model(config, seed=1)
    plain = Path(root) / "plain"
    hf.save_pretrained(plain)
    mtp = Path(root) / "mtp"
    shutil.copytree(plain, mtp)
    add_mtp_layer(mtp, load_checkpoint(plain))
    return hf, plain, mtp


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Any, Path, Path]:
    return _checkpoints(str(tmp_path_factory.mktemp("qwen3_next_mtp")))


def _serve(directory: Path, *, max_total_tokens: int) -> tuple[Scheduler, dict[str, ServingReq]]:
    model = load_checkpoint(directory)
    assert model.spec.num_nextn_predict_layers == 1  # read from mtp_num_hidden_layers
    cache = build_kv_cache(
        model.spec,
        CacheConfig(
            context_length=CONTEXT_LENGTH,
            chunked_prefill_size=CHUNK,
            page_size=1,
            max_total_tokens=max_total_tokens,
            max_running_requests=8,
            speculative_algorithm="NEXTN",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
        ),
    )
    assert cache.plan.draft is not None and cache.plan.draft.layer_ids == (model.spec.num_hidden_layers,)
    sched = eagle_scheduler(
        model.config,
        cache,
        model.params,
        draft_params=nextn_params(model.config, model.params, directory),
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    done = serve_two_rounds(sched, MAX_NEW)  # asserts the KV is leak free
    table, tree = sched.cache.req_to_token_pool, sched.cache.tree_cache
    assert isinstance(tree, MambaRadixCache)
    tree.sanity_check()
    held = tree.mamba_evictable_size() + tree.mamba_protected_size()
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    return sched, done


def _proposer(sched: Scheduler) -> EagleDecoding:
    assert isinstance(sched.proposer, EagleDecoding)
    return sched.proposer


class _TorchMTP:
    """The MTP layer computed directly in torch from the checkpoint's ``mtp.*`` tensors: Transformers'
    ``Qwen3NextDecoderLayer`` (a full-attention one) and ``Qwen3NextRMSNorm`` (``1 + w``) with the
    target's embedding, rotary embedding and head."""

    def __init__(self, hf: Any, directory: Path) -> None:
        from safetensors.torch import load_file
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        tensors = {k[4:]: v for k, v in load_file(str(directory / "model.safetensors")).items() if k[:4] == "mtp."}
        c = hf.config
        self.hf = hf
        self.layer = m.Qwen3NextDecoderLayer(c, _FULL_LAYER).eval()
        layer = {k[len("layers.0.") :]: v for k, v in tensors.items() if k.startswith("layers.0.")}
        self.layer.load_state_dict(layer, strict=True)
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = m.Qwen3NextRMSNorm(c.hidden_size, eps=c.rms_norm_eps).eval()
            norm.load_state_dict({"weight": tensors[f"{name}.weight"]})
            self.norms[name] = norm
        self.fc = tensors["fc.weight"]

    @torch.no_grad()
    def __call__(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [T, vocab], output hidden [T, hidden])`` of the MTP layer over ``tokens`` at
        positions ``0..T-1``, token ``i`` with ``hidden[i]`` (causal attention over the sequence)."""
        ids = torch.tensor([tokens])
        e = self.norms["pre_fc_norm_embedding"](self.hf.model.embed_tokens(ids))
        h = self.norms["pre_fc_norm_hidden"](hidden[None])
        x = torch.cat([e, h], dim=-1) @ self.fc.T
        positions = torch.arange(len(tokens))[None]
        rope = self.hf.model.rotary_emb(x, positions)
        t = len(tokens)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.layer(x, position_embeddings=rope, attention_mask=mask, position_ids=positions)
        out = self.norms["norm"](x)
        return self.hf.lm_head(out)[0], out[0]

    @torch.no_grad()
    def proposals(self, sequence: list[int], k: int) -> list[int]:
        """The ``k`` chained proposals of a round whose last token is ``sequence[-1]``: every earlier
        position fed the target's hidden state of the position before (Transformers'), each
        proposal after the first fed the draft's own output hidden state (EAGLE's chain)."""
        target = self.hf.model(torch.tensor([sequence])).last_hidden_state[0]
        hidden = torch.cat([torch.zeros_like(target[:1]), target[:-1]])
        tokens, out = list(sequence), []
        for _ in range(k):
            logits, own = self(tokens, hidden)
            out.append(int(logits[-1].argmax()))
            tokens.append(out[-1])
            hidden = torch.cat([hidden, own[-1:]])
        return out


def test_reuse_multi_turn_chunked_prefill_and_the_mtp_layers_own_proposals(checkpoints, monkeypatch):
    hf, _, directory = checkpoints
    rounds: list[tuple[list[list[int]], np.ndarray]] = []
    settle = DraftDecoding._settle_round

    def recording(self: Any, s: Any, running: list[ServingReq], kv_len: Any, proposals: Any, *rest: Any) -> Any:
        rounds.append(([list(r.origin_input_ids) + list(r.output_ids) for r in running], np.asarray(proposals)))
        return settle(self, s, running, kv_len, proposals, *rest)

    monkeypatch.setattr(DraftDecoding, "_settle_round", recording)
    sched, done = _serve(directory, max_total_tokens=2048)
    stats = _proposer(sched).stats
    print("Qwen3-Next random MTP layer:", _proposer(sched).report())
    assert stats.rounds > 0 and stats.proposed_tokens == K * stats.request_rounds
    assert stats.accepted_tokens < stats.proposed_tokens / 2, stats  # random: most proposals rejected
    assert stats.replayed_requests > 0 and stats.rolled_back_slots > 0, stats  # the state replayed
    assert sched.stats.cached_tokens > 0  # later prompts start from the tree's state checkpoints
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    direct = _TorchMTP(hf, directory)
    checked = 0
    for sequences, proposals in rounds[:6]:
        for row, sequence in enumerate(sequences):
            assert list(proposals[row]) == direct.proposals(sequence, K), (sequence, proposals[row])
            checked += 1
    assert checked >= 6


def test_a_pool_small_enough_to_evict_and_retract(checkpoints):
    hf, _, directory = checkpoints
    sched, done = _serve(directory, max_total_tokens=64)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert _proposer(sched).stats.replayed_requests > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_a_checkpoint_without_the_mtp_layer_is_refused_by_name(checkpoints):
    _, plain, _ = checkpoints
    model = load_checkpoint(plain)
    assert model.spec.num_nextn_predict_layers == 0
    with pytest.raises(ConfigError, match="speculative_algorithm.*mtp_num_hidden_layers=0"):
        nextn_params(model.config, model.params, plain)
    with pytest.raises(ConfigError, match="speculative_algorithm.*no MTP layers"):
        build_kv_cache(model.spec, CacheConfig(context_length=64, speculative_algorithm="NEXTN"))


def test_generate_with_the_mtp_layer_gives_the_plain_tokens(checkpoints, capsys):
    from kvjax.cli import main

    _, plain, directory = checkpoints
    argv = ["generate", "--model", str(directory), "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "1,2,3,4,5,6,7"]
    argv += ["--max-new-tokens", "6", "--ignore-eos", "--page-size", "1", "--json"]
    assert main(argv) == 0
    alone = json.loads(capsys.readouterr().out)
    flags = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1"]
    assert main([*argv, *flags, "--speculative-num-draft-tokens", "3"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["outputs"] == alone["outputs"]
    assert drafted["speculative"]["num_steps"] == 2 and drafted["speculative"]["proposed_tokens"] > 0
    try:  # the plain checkpoint has no MTP layer: one error line naming the flag
        code = main(["generate", "--model", str(plain), "--prompt-ids", "1,2", "--speculative-algorithm", "EAGLE"])
    except SystemExit as e:
        code = int(e.code or 0)
    _, err = capsys.readouterr()
    assert code == 2 and "--speculative-algorithm EAGLE" in err and "mtp" in err.lower(), err


def test_a_sparse_moe_models_mtp_layer_has_the_sparse_moe_under_sglangs_names():
    """With experts, the MTP layer's MLP is the family's sparse MoE (SGLang builds every Qwen3-Next
    layer sparse), its tensors ``mtp.layers.0.mlp.*`` as Qwen3-Next checkpoints name them."""
    from kvjax import ModelSpec
    from kvjax.serve.model_config import model_config_from_spec
    from tests.serve.random_workloads import QWEN3_NEXT_TINY

    moe = dict(
        QWEN3_NEXT_TINY,
        mlp_only_layers=[],
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        mtp_num_hidden_layers=1,
    )
    spec = ModelSpec.from_hf_config(moe, name="qwen3-next-moe")
    assert spec.num_nextn_predict_layers == 1
    config = model_config_from_spec(spec)
    named = nextn_tensor_names(config)
    names = set(named.values())
    shapes = {named[p]: tuple(s.shape) for p, s in flatten_params(nextn_param_shapes(config)) if p in named}
    hidden = spec.hidden_size
    assert shapes["mtp.fc.weight"] == (hidden, 2 * hidden)
    assert shapes["mtp.layers.0.mlp.gate.weight"] == (4, hidden)
    assert shapes["mtp.layers.0.mlp.experts.3.down_proj.weight"] == (hidden, 24)
    assert shapes["mtp.layers.0.mlp.shared_expert.up_proj.weight"] == (40, hidden)
    assert shapes["mtp.layers.0.mlp.shared_expert_gate.weight"] == (1, hidden)
    assert {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"} <= names
    assert "mtp.layers.0.self_attn.q_proj.weight" in names and not any("linear_attn" in n for n in names)
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)  # the target's, shared
