"""kvjax.serve.moe.SparseMoE against the transformers MoE blocks it stands for, with random weights:
DeepSeek-V2 (greedy and group-limited greedy), DeepSeek-V3 (noaux_tc, sigmoid scores, correction
bias, normalised top-k), Qwen2-MoE and Qwen3-Next (gated shared expert, normalised top-k). The
shared experts run both ways (``kvjax.serve.moe``): as more experts in the routed experts'
contraction (a multiple of their size) and on their own (12 units over experts of 8)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.serve.moe import MoEConfig, SparseMoE, route

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

H, I_EXPERT, E, TOKENS = 16, 8, 8, 24


def _randomise(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)


def _params_from_torch(module: torch.nn.Module, config: MoEConfig) -> dict:
    """The SparseMoE parameter tree from a transformers MoE block's state (experts stacked in
    transformers 5 as ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, split per expert as
    ``save_pretrained`` writes them)."""
    state = {k: np.asarray(v.detach().float()) for k, v in module.state_dict().items()}
    gate = {"weight": state["gate.weight"]}
    if "gate.e_score_correction_bias" in state:
        gate["e_score_correction_bias"] = state["gate.e_score_correction_bias"]
    params: dict = {"gate": gate}
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    inter = config.moe_intermediate_size
    for e in range(config.num_experts):
        params[f"experts_{e}"] = {
            "gate_proj": {"weight": gate_up[e, :inter]},
            "up_proj": {"weight": gate_up[e, inter:]},
            "down_proj": {"weight": down[e]},
        }
    if config.shared_intermediate_size:
        name = config.shared_name
        params[name] = {p: {"weight": state[f"{name}.{p}.weight"]} for p in ("gate_proj", "up_proj", "down_proj")}
    if config.shared_expert_gated:
        params["shared_expert_gate"] = {"weight": state["shared_expert_gate.weight"]}
    return params


def _compare(hf_block: torch.nn.Module, config: MoEConfig, seed: int) -> None:
    _randomise(hf_block, seed)
    hf_block.eval()
    x = np.random.default_rng(seed).standard_normal((TOKENS, H)).astype(np.float32)
    with torch.no_grad():
        want = hf_block(torch.from_numpy(x)[None]).numpy()[0]
    params = _params_from_torch(hf_block, config)
    got = SparseMoE(config, jnp.float32).apply({"params": params}, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


# Every block: H wide, E experts of I_EXPERT (the attention heads are the configs' own, unused).
HF_BLOCK = {"hidden_size": H, "num_attention_heads": 2, "num_key_value_heads": 2, "moe_intermediate_size": I_EXPERT}
OUR_BLOCK = {"hidden_size": H, "num_experts": E, "moe_intermediate_size": I_EXPERT}
# DeepSeek's routing: 3 experts from the best 2 of 4 groups.
HF_DEEPSEEK = {**HF_BLOCK, "n_routed_experts": E, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2}
OUR_DEEPSEEK = {**OUR_BLOCK, "top_k": 3, "n_group": 4, "topk_group": 2}


def _deepseek_v2(topk_method: str, **kw) -> tuple[torch.nn.Module, MoEConfig]:
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    routing = {"topk_method": topk_method, "routed_scaling_factor": 1.5}
    cfg = transformers.DeepseekV2Config(**HF_DEEPSEEK, **routing, n_shared_experts=2, **kw)
    ours = MoEConfig(**OUR_DEEPSEEK, **routing, shared_intermediate_size=2 * I_EXPERT)
    return DeepseekV2Moe(cfg), ours


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_moe(topk_method: str) -> None:
    _compare(*_deepseek_v2(topk_method), seed=1)


def test_deepseek_v3_moe_noaux_tc() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    routing = {"norm_topk_prob": True, "routed_scaling_factor": 2.5}
    cfg = transformers.DeepseekV3Config(**HF_DEEPSEEK, **routing, n_shared_experts=1)
    ours = MoEConfig(
        **OUR_DEEPSEEK, **routing, scoring="sigmoid", topk_method="noaux_tc", shared_intermediate_size=I_EXPERT
    )
    _compare(DeepseekV3MoE(cfg), ours, seed=2)


@pytest.mark.parametrize("shared_size", [2 * I_EXPERT, 12])
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_next"])
def test_qwen_moe_with_gated_shared_expert(family: str, shared_size: int) -> None:
    """A shared expert of twice the experts' size joins their contraction as two more experts
    weighted by its gate; one of 12 (not a multiple of 8) keeps its own down projection."""
    if family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block

        config_class = transformers.Qwen2MoeConfig
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block

        config_class = transformers.Qwen3NextConfig
    routing = {"norm_topk_prob": True}
    cfg = config_class(
        **HF_BLOCK, **routing, num_experts=E, num_experts_per_tok=2, shared_expert_intermediate_size=shared_size
    )
    shared = {"shared_intermediate_size": shared_size, "shared_expert_gated": True, "shared_name": "shared_expert"}
    ours = MoEConfig(**OUR_BLOCK, **routing, top_k=2, **shared)
    _compare(Block(cfg), ours, seed=3)


def test_route_group_limited_keeps_only_the_best_groups() -> None:
    config = MoEConfig(
        hidden_size=1, num_experts=4, top_k=2, moe_intermediate_size=1, topk_method="group_limited_greedy", n_group=2
    )
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))  # group 1 = experts 2, 3 holds the best
    weights, ids = route(config, logits)
    assert sorted(np.asarray(ids[0]).tolist()) == [2, 3]
    np.testing.assert_allclose(np.sort(np.asarray(weights[0])), [0.3, 0.4], rtol=1e-6)


def test_bad_config_names_the_value() -> None:
    with pytest.raises(ValueError, match="topk_method='top1'"):
        MoEConfig(hidden_size=1, num_experts=2, top_k=1, moe_intermediate_size=1, topk_method="top1")
    with pytest.raises(ValueError, match="top_k=3"):
        MoEConfig(hidden_size=1, num_experts=2, top_k=3, moe_intermediate_size=1)
    with pytest.raises(ValueError, match="n_group=3"):
        MoEConfig(hidden_size=1, num_experts=4, top_k=1, moe_intermediate_size=1, topk_method="noaux_tc", n_group=3)
