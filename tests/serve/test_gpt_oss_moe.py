"""gpt-oss's MoE block matches Transformers' ``GptOssMLP`` where the SwiGLU clamps engage, and its
RMSNorm rounds as Transformers' in bfloat16.

The parity test's random weights rarely push the experts' gate/up past ``swiglu_limit``; here the
expert weights are scaled up (and the limit lowered) so that both clamps and the interleaved
gate/up columns decide the result, and kvjax's block is run on the very tensors Transformers holds.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the 'parity' extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="needs the 'parity' extra (torch, transformers)")

from kvjax import ModelSpec  # noqa: E402
from kvjax.serve.families.gpt_oss import GptOssMLP, GptOssRMSNorm  # noqa: E402
from kvjax.serve.model_config import model_config_from_spec  # noqa: E402


def test_experts_and_router_match_transformers_with_the_clamps_engaged():
    hf_config = transformers.GptOssConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=3.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    mlp = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(hf_config).to(torch.float32).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 1.0)
    x = torch.randn(1, 24, 16)
    with torch.no_grad():
        expected, _ = mlp(x)
        gate_up = x.reshape(-1, 16) @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    assert float(gate_up[:, ::2].max()) > 3.0 and float(gate_up[:, 1::2].min()) < -3.0, "clamps not engaged"
    config = model_config_from_spec(ModelSpec.from_hf_config(hf_config.to_dict()))
    params = {
        "router": {"weight": mlp.router.weight, "bias": mlp.router.bias},
        "experts": {
            name: getattr(mlp.experts, name)
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        },
    }
    params = {m: {k: jnp.asarray(v.detach().numpy()) for k, v in d.items()} for m, d in params.items()}
    ours = GptOssMLP(config).apply({"params": params}, jnp.asarray(x[0].numpy()))
    np.testing.assert_allclose(np.asarray(ours), expected[0].numpy(), rtol=1e-5, atol=1e-4)


def test_rms_norm_multiplies_in_float32_before_casting_like_transformers_in_bfloat16():
    torch.manual_seed(1)
    norm = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    norm = norm.to(torch.bfloat16)
    x = torch.randn(32, 64).to(torch.bfloat16)
    with torch.no_grad():
        expected = norm(x).float().numpy()
    weight = jnp.asarray(norm.weight.detach().float().numpy()).astype(jnp.bfloat16)
    ours = GptOssRMSNorm(1e-5, jnp.dtype(jnp.bfloat16)).apply(
        {"params": {"weight": weight}}, jnp.asarray(x.float().numpy()).astype(jnp.bfloat16)
    )
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), expected)
