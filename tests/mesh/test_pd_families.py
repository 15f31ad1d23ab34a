"""Prefill/decode disaggregation of every cache kind across two processes on loopback (issue 36).

``test_pd_llama`` proves full attention; this file moves the other kinds' caches, each prefill
server and decode server a process of its own on 4 CPU devices (``pd_pair``), at different page
sizes on the two sides:

* Gemma 3 (sliding-window and full layers, window 8; prefill tp 2 -> decode tp 1): prompts longer
  than the window, so the window side moves only the window's tokens while the full side moves
  every token; the decode side's windows then slide past the prompt; and Mistral with a window on
  every layer (one pool, tp 1 -> tp 2: only the prompt's last window moves);
* Qwen3-Next (gated delta net + full attention; tp 2 -> tp 2): the request's recurrent-state slot
  moves with its full-attention rows. Two sides whose state is split over different TP sizes are
  refused by the handshake's signature (the conv channels' order depends on the split); and
  Nemotron-H's Mamba2 state (two groups, tp 2 -> tp 2);
* DeepSeek-V2 (MLA; tp 4 -> tp 2): the latent rows, replicated over each side's mesh; and the same
  with an fp8 latent cache (its scale moves with the rows; compared with colocated fp8 serving);
* a speculative cache's draft pool ``kv_draft`` (in process, the transfer alone; a speculative
  decode server is served in ``test_pd_speculative``): it moves with the target's, each of the
  draft's own KV heads once, between tp 2 and tp 1.

Each: greedy tokens equal Transformers' and the decode side's logits within the family's parity
tolerance (its first token comes from the prefill server, every later one from a decode step over
the pulled cache), equal to one colocated server's (same tokens, logits within the tolerance), and
both sides leak free. SGLang refuses the decode-side radix cache for SWA and Mamba models, so
those decode servers run without one (``--no-decode-radix``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.mesh.pd_pair import PrefillProcess, pd_env, run_decode

pytestmark = pytest.mark.mesh

MAX_NEW = 6
FP8_ATOL = 1e-4  # fp8 disaggregated against fp8 colocated: the same stored bytes, the same math


def _rounds(vocab: int, seed: int) -> list[list[dict[str, Any]]]:
    """Three prompts of 17 to 37 tokens, two sharing a 16-token prefix (reused on the prefill side)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 16).tolist()
    prompts = {
        "a": shared + rng.integers(0, vocab, 9).tolist(),
        "b": shared + rng.integers(0, vocab, 1).tolist(),
        "c": rng.integers(0, vocab, 37).tolist(),
    }
    return [[{"rid": rid, "prompt": p, "max_new": MAX_NEW} for rid, p in prompts.items()]]


def _serve_pair(
    checkpoint: Path, tmp: Path, rounds: Any, prefill: list[str], decode: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The decode side's and the prefill side's reports of ``rounds`` served disaggregated."""
    env = pd_env()
    server = PrefillProcess(checkpoint, env, *prefill)
    try:
        report = run_decode(checkpoint, env, rounds, tmp, *decode, "--prefill", server.address)
    finally:
        prefill_report = server.stop() if server.proc.poll() is None else {}
    return report, prefill_report


def _colocated(checkpoint: Path, tmp: Path, rounds: Any, *args: str) -> dict[str, Any]:
    """The same rounds on one ordinary server, in this process (its first devices)."""
    import json

    from tests.mesh import pd_process

    requests = tmp / "colocated.json"
    requests.write_text(json.dumps(rounds))
    return pd_process.serve_colocated(
        pd_process.parser().parse_args(
            ["colocated", "--checkpoint", str(checkpoint), "--requests", str(requests), *args]
        )
    )


def _check(
    hf: Any,
    rounds: Any,
    report: dict[str, Any],
    prefill_report: dict[str, Any],
    colocated: dict[str, Any],
    atol: float,
) -> None:
    from tests.serve.parity_harness import MARGIN_FACTOR, assert_no_near_tie, hf_greedy

    assert report["failed"] == {}
    requests = [r for round_ in rounds for r in round_]
    for r in requests:
        rid, tokens = r["rid"], report["outputs"][r["rid"]]
        ours = np.asarray(report["logits"][rid], np.float32)
        assert ours.shape == (MAX_NEW - 1, len(colocated["logits"][rid][0])), f"{rid}: {ours.shape} decode-side logits"
        if hf is not None:
            want, want_logits = hf_greedy(hf, r["prompt"], MAX_NEW)
            assert_no_near_tie(rid, want_logits, MARGIN_FACTOR * atol)
            assert tokens == want, f"{rid}: disaggregated {tokens} != transformers {want}"
            np.testing.assert_allclose(ours, want_logits[1:], atol=atol, rtol=0, err_msg=f"{rid}: logits")
        assert tokens == colocated["outputs"][rid], f"{rid}: disaggregated {tokens} != colocated"
        np.testing.assert_allclose(
            ours, np.asarray(colocated["logits"][rid])[1:], atol=atol, rtol=0, err_msg=f"{rid}: colocated logits"
        )
    assert report["leak_free"], "decode side: slots, rows or state slots left"
    assert colocated["leak_free"]
    assert prefill_report == {**prefill_report, "leak_free": True, "snapshots": 0, "prefilled": len(requests)}
    assert report["pulled_tokens"] == sum(len(r["prompt"]) for r in requests) - report["reused_tokens"]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from tests.mesh.tp_serving import family_config
    from tests.serve.parity_harness import saved_transformers_model

    return saved_transformers_model(family_config("gemma3"), tmp_path_factory, "pd-gemma3")


def test_gemma3_sliding_window_moves_tp2_to_tp1(gemma3, tmp_path):
    from tests.serve.swa_parity import LOGIT_ATOL
    from tests.serve.test_parity_gemma3 import WINDOW

    hf, checkpoint = gemma3
    rounds = _rounds(hf.config.vocab_size, seed=21)
    assert all(len(r["prompt"]) > WINDOW for r in rounds[0])
    report, prefill_report = _serve_pair(
        checkpoint,
        tmp_path,
        rounds,
        ["--tp", "2", "--page-size", "4"],
        # kvjax builds no host tier over a disabled sliding-window tree: the CPU-tensor backup
        ["--tp", "1", "--page-size", "2", "--no-decode-radix", "--retraction-backup", "cpu_tensor"],
    )
    colocated = _colocated(checkpoint, tmp_path, rounds, "--tp", "1", "--page-size", "2")
    _check(hf, rounds, report, prefill_report, colocated, LOGIT_ATOL)


def test_pure_sliding_window_mistral_moves_only_its_window_tp1_to_tp2(tmp_path_factory, tmp_path):
    """Mistral with a window on every layer: one pool under a plain allocator, the request table
    holding window slots (zeros once freed); only the prompt's last window moves."""
    from tests.serve.parity_harness import saved_transformers_model, transformers
    from tests.serve.test_parity_mistral_swa import CONFIG, LOGIT_ATOL, WINDOW

    hf, checkpoint = saved_transformers_model(transformers.MistralConfig(**CONFIG), tmp_path_factory, "pd-mistral")
    rounds = _rounds(hf.config.vocab_size, seed=25)
    assert all(len(r["prompt"]) > WINDOW for r in rounds[0])
    report, prefill_report = _serve_pair(
        checkpoint,
        tmp_path,
        rounds,
        ["--tp", "1", "--page-size", "4"],
        ["--tp", "2", "--page-size", "1", "--no-decode-radix", "--retraction-backup", "cpu_tensor"],
    )
    assert any(s.startswith("swa.swa.rows") for s in report["signature"]), report["signature"]
    assert not any(s.startswith("swa.full.") for s in report["signature"]), report["signature"]
    colocated = _colocated(checkpoint, tmp_path, rounds, "--tp", "2", "--page-size", "1")
    _check(hf, rounds, report, prefill_report, colocated, LOGIT_ATOL)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from tests.mesh.qwen3_next_tp import HEADS, LAYERS
    from tests.serve.parity_harness import TINY_CONFIG, saved_transformers_model, transformers
    from tests.serve.test_parity_qwen3_next import MODEL_SEED

    config = transformers.Qwen3NextConfig(**TINY_CONFIG, **LAYERS, **HEADS[2])
    return saved_transformers_model(config, tmp_path_factory, "pd-qwen3-next", seed=MODEL_SEED)


def test_qwen3_next_recurrent_state_moves_tp2_to_tp2(qwen3_next, tmp_path):
    from tests.mesh.qwen3_next_tp import ATOL

    hf, checkpoint = qwen3_next
    rounds = _rounds(hf.config.vocab_size, seed=22)
    report, prefill_report = _serve_pair(
        checkpoint,
        tmp_path,
        rounds,
        ["--tp", "2", "--page-size", "1"],
        ["--tp", "2", "--page-size", "4", "--no-decode-radix"],
    )
    # a colocated recurrent-state tree takes page size 1 (larger pages need the extra buffer)
    colocated = _colocated(checkpoint, tmp_path, rounds, "--tp", "2", "--page-size", "1")
    _check(hf, rounds, report, prefill_report, colocated, ATOL)


def test_nemotron_h_mamba2_state_moves_tp2_to_tp2(tmp_path_factory, tmp_path):
    """Nemotron-H (Mamba2 mixers of two groups, one attention block): the Mamba2 conv and SSM
    state moves with the attention rows. Its parity test compares logits with Transformers' full
    forward (its cached generate differs), so here: Transformers' greedy tokens, and the logits of
    colocated serving (which that test holds to Transformers)."""
    import torch

    from tests.serve.parity_harness import TINY_CONFIG, saved_transformers_model, transformers
    from tests.serve.random_workloads import NEMOTRON_H_BLOCKS, TINY_LAYER_SIZES
    from tests.serve.test_parity_nemotron_h import LOGIT_ATOL, MODEL_SEED

    config = transformers.NemotronHConfig(**TINY_CONFIG, **TINY_LAYER_SIZES, **NEMOTRON_H_BLOCKS)
    hf, checkpoint = saved_transformers_model(config, tmp_path_factory, "pd-nemotron-h", seed=MODEL_SEED)
    rounds = _rounds(hf.config.vocab_size, seed=26)
    report, prefill_report = _serve_pair(
        checkpoint,
        tmp_path,
        rounds,
        ["--tp", "2", "--page-size", "1"],
        ["--tp", "2", "--page-size", "2", "--no-decode-radix"],
    )
    colocated = _colocated(checkpoint, tmp_path, rounds, "--tp", "2", "--page-size", "1")
    _check(None, rounds, report, prefill_report, colocated, LOGIT_ATOL)
    for r in rounds[0]:
        with torch.no_grad():
            want = hf.generate(torch.tensor([r["prompt"]]), max_new_tokens=MAX_NEW, do_sample=False)
        assert report["outputs"][r["rid"]] == want[0, len(r["prompt"]) :].tolist(), r["rid"]


def test_recurrent_states_split_over_different_tp_sizes_are_refused_by_the_signature(qwen3_next):
    from kvjax import CacheConfig, build_kv_cache
    from kvjax.disaggregation.kv_transfer import CacheMovers
    from kvjax.serve.checkpoint import load_checkpoint
    from tests.mesh.tp_serving import mesh_of

    _, checkpoint = qwen3_next
    spec = load_checkpoint(checkpoint).spec

    def signature(tp: int, role: str) -> set[str]:
        config = CacheConfig(
            context_length=256,
            max_total_tokens=512,
            page_size=1,
            tp_size=tp,
            disaggregation_mode=role,
            disable_radix_cache=role == "decode",
        )
        return set(CacheMovers(build_kv_cache(spec, config, mesh=mesh_of(tp) if tp > 1 else None)).signature())

    prefill, decode = signature(2, "prefill"), signature(1, "decode")
    assert prefill - decode == {"recurrent: recurrent state split over tp=2"}
    assert decode - prefill == {"recurrent: recurrent state split over tp=1"}
    assert signature(2, "decode") == prefill


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from tests.mesh.tp_serving import family_config
    from tests.serve.parity_harness import saved_transformers_model

    return saved_transformers_model(family_config("deepseek_v2"), tmp_path_factory, "pd-deepseek-v2")


def test_deepseek_v2_mla_latent_moves_tp4_to_tp2(deepseek_v2, tmp_path):
    from tests.serve.test_parity_deepseek_v2 import LOGIT_ATOL

    hf, checkpoint = deepseek_v2
    rounds = _rounds(hf.config.vocab_size, seed=23)
    report, prefill_report = _serve_pair(
        checkpoint, tmp_path, rounds, ["--tp", "4", "--page-size", "4"], ["--tp", "2", "--page-size", "8"]
    )
    colocated = _colocated(checkpoint, tmp_path, rounds, "--tp", "2", "--page-size", "8")
    _check(hf, rounds, report, prefill_report, colocated, LOGIT_ATOL)


def test_deepseek_v2_fp8_latent_and_its_scale_move(deepseek_v2, tmp_path):
    """An fp8 latent cache: the rows move as stored (1 byte each) with the per-layer scale; the
    tokens and logits equal one colocated fp8 server's (Transformers has no fp8 cache to compare)."""
    _, checkpoint = deepseek_v2
    rounds = _rounds(128, seed=24)
    fp8 = ("--kv-cache-dtype", "fp8_e4m3")
    report, prefill_report = _serve_pair(
        checkpoint, tmp_path, rounds, ["--tp", "2", "--page-size", "4", *fp8], ["--tp", "2", "--page-size", "8", *fp8]
    )
    assert any(".scale[" in s for s in report["signature"]), report["signature"]
    assert any(".rows[" in s and s.endswith(":uint8") for s in report["signature"]), report["signature"]
    colocated = _colocated(checkpoint, tmp_path, rounds, "--tp", "2", "--page-size", "8", *fp8)
    _check(None, rounds, report, prefill_report, colocated, FP8_ATOL)


def test_a_draft_models_pool_moves_with_its_own_heads_across_tp_sizes():
    """A speculative cache's ``kv_draft`` (a one-layer draft of 1 KV head, held twice at tp 2)
    moves each of the draft's heads once: the signatures of tp 2 and tp 1 caches agree, and a
    request's target and draft rows gathered at tp 2 land unchanged in a tp 1 cache."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from kvjax import CacheConfig, ModelSpec, build_kv_cache
    from kvjax.disaggregation.kv_transfer import CacheMovers
    from kvjax.transfers.request_kv import RequestSpan
    from tests.mesh.tp_serving import mesh_of

    spec = ModelSpec.preset("tiny")
    draft = dataclasses.replace(
        spec, name="tiny-draft", num_hidden_layers=1, layer_kinds=spec.layer_kinds[:1], num_kv_heads=1
    )

    def cache(tp: int, page_size: int) -> Any:
        config = CacheConfig(
            page_size=page_size,
            context_length=64,
            max_total_tokens=128,
            tp_size=tp,
            speculative_algorithm="STANDALONE",
            speculative_num_steps=2,
            speculative_num_draft_tokens=3,
        )
        return build_kv_cache(spec, config, mesh=mesh_of(tp) if tp > 1 else None, draft_spec=draft)

    src, dst = cache(2, 4), cache(1, 1)
    movers, theirs = CacheMovers(src), CacheMovers(dst)
    assert {m.name: m.kv_heads for m in movers.movers} == {"kv": 2, "kv_draft": 1}
    assert src.pools["kv_draft"].num_kv_heads == 2, "at tp 2 the draft's one head is held twice"
    assert movers.signature() == theirs.signature()
    rng = np.random.default_rng(9)
    pools = src.pools
    for name in ("kv", "kv_draft"):
        pool = pools[name]
        # one head's copies hold the same values: draw per distinct head, then repeat
        layers = []
        for a in pool.kv:
            replicas = pool.num_kv_heads // {"kv": 2, "kv_draft": 1}[name]
            pages, ps, c, d = a.shape
            once = rng.standard_normal((pages, ps, c // (2 * replicas), 1, 2, d)).astype(np.float32)
            full = np.broadcast_to(once, (pages, ps, c // (2 * replicas), replicas, 2, d)).reshape(a.shape)
            layers.append(jax.device_put(jnp.asarray(full, a.dtype), a.sharding))
        pools = pools.replace(**{name: pool.replace(kv=tuple(layers))})
    here = np.asarray([4, 5, 6, 7, 8, 9], np.int32)
    there = np.asarray([3, 1, 2, 7, 5, 6], np.int32)
    out = theirs.scatter(dst.pools, movers.gather(pools, RequestSpan(0, 6, here)), RequestSpan(0, 6, there))
    for name in ("kv", "kv_draft"):
        replicas = pools[name].num_kv_heads // {"kv": 2, "kv_draft": 1}[name]
        for mine, got in zip(pools[name].kv, out[name].kv, strict=True):
            want = np.asarray(mine).reshape(-1, mine.shape[2] // (2 * replicas), replicas, 2, mine.shape[3])[here][
                :, :, 0
            ]
            np.testing.assert_array_equal(
                np.asarray(got).reshape(-1, *got.shape[2:])[there], want.reshape(6, -1, mine.shape[3]), err_msg=name
            )


@pytest.mark.parametrize("lane_dense", [False, True])
def test_the_recurrent_slot_write_over_a_mesh_is_in_place_on_the_pools_sharding(lane_dense):
    """The recurrent state's write over a tp 2 mesh: each device's shard written where it lies
    (the pool's sharding kept), the old buffers donated; lane-dense storage (TPU's) too."""
    import jax
    import jax.numpy as jnp

    from kvjax.pools.recurrent import RecurrentStatePool
    from kvjax.transfers.request_kv import RecurrentRequestKV, RequestSpan
    from tests.mesh.tp_serving import mesh_of

    def pool(seed: int | None = None) -> RecurrentStatePool:
        made = RecurrentStatePool.create(
            num_slots=4,
            layer_ids=(0, 1),
            conv_state_shapes=((64, 2),),  # one rank's: 128 elements, whole lanes
            ssm_state_shape=(2, 4, 4),
            conv_dtype="float32",
            mesh=mesh_of(2),
            lane_dense=lane_dense,
        )
        if seed is None:
            return made
        rng = np.random.default_rng(seed)
        return made.replace(
            conv=tuple(
                jax.device_put(jnp.asarray(rng.standard_normal(a.shape), a.dtype), a.sharding) for a in made.conv
            ),
            ssm=jax.device_put(jnp.asarray(rng.standard_normal(made.ssm.shape), made.ssm.dtype), made.ssm.sharding),
        )

    mover = RecurrentRequestKV()
    src, dst = pool(10), pool()
    pieces = mover.gather(src, RequestSpan(0, 1, np.asarray([1], np.int32), state_slot=3), 1)
    assert [tuple(p.shape) for p in pieces] == [(2, 1, 128, 2), (2, 1, 4, 4, 4)]
    old = list(dst.arrays())
    out = mover.scatter(dst, pieces, RequestSpan(0, 1, np.asarray([1], np.int32), state_slot=2), 1)
    assert all(a.is_deleted() for a in old), "the state pool was copied, not written in place"
    assert all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in zip(out.arrays(), old, strict=True))
    for layer in (0, 1):
        got, want = out.get_states(layer, np.asarray([2])), src.get_states(layer, np.asarray([3]))
        for g, w in zip((*got[0], got[1]), (*want[0], want[1]), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
