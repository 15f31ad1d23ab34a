"""A checkpoint's multi-token-prediction (MTP, "NextN") layer as an EAGLE-style draft model:
DeepSeek's (here) and Qwen3-Next's (``qwen3_next_mtp``; the same call, its own names and layer).

DeepSeek-V3 checkpoints (``num_nextn_predict_layers: 1``) carry one more layer after the decoder
stack, ``model.layers.{num_hidden_layers}``: ``enorm`` and ``hnorm`` (RMSNorms), ``eh_proj``
(``[hidden, 2 * hidden]``), one decoder layer of the target's kind (MLA, and the sparse MoE when
the target has routed experts: its id is past ``first_k_dense_replace``) and ``shared_head.norm``.
Its embedding and LM head are the target's (the checkpoint's copies, ``embed_tokens`` and
``shared_head.head``, are not read), as SGLang's ``deepseek_nextn.py`` shares them.

A draft step at position ``p`` takes the token there and a hidden state ``h`` (the target's at
``p - 1``, or the draft's own output of the step before: EAGLE's chain)::

    x = eh_proj([enorm(embed(token)), hnorm(h)])
    x = decoder_layer(x)                  # writes the draft's KV at p (pool "kv_draft")
    h' = shared_head.norm(x)              # the draft's output hidden state
    logits = lm_head(h')                  # the proposal for p + 1

``h`` is the target's final-normed hidden state (``CausalLM(return_hidden=True)``), the one
SGLang's logits processor captures for the MTP draft.

A full-attention Llama target has no MTP layer; its EAGLE draft is a separate one-layer head
(``eagle_head``: SGLang's ``LlamaForCausalLMEagle``, read from ``--speculative-draft-model-path``),
called the same way, whose pool is the draft layer 0 of a cache planned for ``EAGLE``
(``draft_layer_ids``, ``draft_algorithm``).

Per family (``NEXTN_FAMILIES``): the draft module, the one-page pool its weights are traced over,
where its tensors live in the checkpoint and the config key that counts MTP layers
(``num_nextn_predict_layers``; Qwen3-Next's ``mtp_num_hidden_layers``, read into the spec's
``num_nextn_predict_layers``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.pools import CachePools
from kvjax.serve.layers import BatchMetadata, Embedding, Linear, RMSNorm
from kvjax.serve.model import build_model
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.speculative.draft_head import draft_logits, mha_trace_pools
from kvjax.serve.speculative.eagle3_draft import Eagle3Config
from kvjax.serve.speculative.eagle_head import (
    EAGLE_HEAD_ARCHITECTURE,
    EAGLE_HEAD_FAMILIES,
    LlamaEagleHead,
    check_head_config,
    is_eagle_head,
)
from kvjax.serve.speculative.qwen3_next_mtp import (
    QWEN3_NEXT_FAMILY,
    Qwen3NextMTPDraft,
    mtp_tensor_name,
)

__all__ = [
    "DRAFT_FAMILIES",
    "NEXTN_FAMILIES",
    "NextNDraft",
    "NextNDraftModel",
    "draft_algorithm",
    "draft_layer_ids",
    "load_nextn_draft",
    "nextn_draft",
    "nextn_param_shapes",
    "nextn_params",
    "nextn_tensor_names",
]

NEXTN_FAMILIES = ("deepseek_v2", "deepseek_v3", QWEN3_NEXT_FAMILY)
"""The families whose checkpoints kvjax reads an MTP layer from."""

DRAFT_FAMILIES = NEXTN_FAMILIES + EAGLE_HEAD_FAMILIES
"""The target families ``EagleDecoding`` drafts for: an MTP layer, or an EAGLE head (Llama)."""

_SHARED = ("embed_tokens", "lm_head")  # the target's


class _SharedHead(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return RMSNorm(self.eps, self.dtype, name="norm")(x)


class NextNDraft(nn.Module):
    """``(tokens [T], hidden [T, hidden], draft pools, meta) -> (logits [S, vocab] float32 at
    ``meta.logits_indices``, every token's output hidden state [T, hidden], new pools)``.

    ``config``: the target's serving config; ``layer_id``: the MTP layer's global id (the target's
    ``num_hidden_layers``: the draft pool's layer); ``decoder_layer``: the target's decoder layer class.
    """

    config: ModelConfig
    layer_id: int
    decoder_layer: type[nn.Module]

    @nn.compact
    def __call__(
        self, tokens: jax.Array, hidden: jax.Array, pools: CachePools, meta: BatchMetadata
    ) -> tuple[jax.Array, jax.Array, CachePools]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        eps = c.rms_norm_eps
        embed = Embedding(c.vocab_size, c.hidden_size, dt, name="embed_tokens")
        e = RMSNorm(eps, dt, name="enorm")(embed(tokens))
        h = RMSNorm(eps, dt, name="hnorm")(hidden.astype(dt))
        x = Linear(c.hidden_size, False, dt, name="eh_proj")(jnp.concatenate([e, h], axis=-1))
        x, pools = self.decoder_layer(c, self.layer_id, name="decoder")(x, pools, meta)
        out = _SharedHead(eps, dt, name="shared_head")(x)
        return draft_logits(c, embed, out, meta), out, pools


def nextn_draft(target: ModelConfig) -> nn.Module:
    """The MTP draft module of ``target`` (``ConfigError`` for a family without one in kvjax):
    ``NextNDraft`` for DeepSeek, ``Qwen3NextMTPDraft`` for Qwen3-Next, both called alike; for a
    Llama target its EAGLE head (``LlamaEagleHead``)."""
    if target.family in EAGLE_HEAD_FAMILIES:
        return LlamaEagleHead(target, draft_layer_ids(target)[0])
    if target.family not in NEXTN_FAMILIES:
        raise ConfigError(
            "speculative_algorithm",
            "NEXTN",
            f"kvjax reads MTP (NextN) layers from {list(NEXTN_FAMILIES)} checkpoints, not {target.family!r}",
        )
    if target.family == QWEN3_NEXT_FAMILY:
        return Qwen3NextMTPDraft(target, target.num_hidden_layers)
    return NextNDraft(target, target.num_hidden_layers, build_model(target).decoder_layer)


def _trace_pools(target: ModelConfig) -> CachePools:
    """A one-page pool of the MTP layer's attention (DeepSeek: latent; Qwen3-Next: MHA) holding
    only that layer (for tracing the weights)."""
    from kvjax.pools import MLAKVPool

    if target.family == QWEN3_NEXT_FAMILY:
        return mha_trace_pools(target, target.num_hidden_layers)
    if target.family in EAGLE_HEAD_FAMILIES:
        return mha_trace_pools(target, 0)

    f = target.family_config
    kv = MLAKVPool.create(
        num_pages=1,
        page_size=1,
        num_layers=1,
        kv_lora_rank=f.kv_lora_rank,
        qk_rope_head_dim=f.qk_rope_head_dim,
        dtype=target.dtype,
        start_layer=target.num_hidden_layers,
    )
    return CachePools(kv=kv)


def nextn_param_shapes(target: ModelConfig) -> Any:
    """The draft's parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
    from kvjax.attention import trace_metadata

    module = nextn_draft(target)
    args = (
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1, target.hidden_size), jnp.dtype(target.dtype)),
        _trace_pools(target),
        trace_metadata(None),
    )
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *args))["params"]


def nextn_tensor_names(target: ModelConfig) -> dict[tuple[str, ...], str]:
    """The checkpoint tensor of every parameter of the MTP layer's own (not the shared embedding
    and head): DeepSeek's ``model.layers.{num_hidden_layers}.<name>`` (the decoder layer's weights
    at that layer's top level), Qwen3-Next's ``mtp.*`` (``qwen3_next_mtp.mtp_tensor_name``)."""
    from kvjax.serve.checkpoint import flatten_params, param_name

    prefix = f"model.layers.{target.num_hidden_layers}."
    names = {}
    for path, _ in flatten_params(nextn_param_shapes(target)):
        if path[0] in _SHARED:
            continue
        if target.family == QWEN3_NEXT_FAMILY:
            names[path] = mtp_tensor_name(path, param_name)
        elif target.family in EAGLE_HEAD_FAMILIES:  # the head's own checkpoint, no "model." prefix
            names[path] = param_name(path)
        else:
            names[path] = prefix + param_name(path[1:] if path[0] == "decoder" else path)
    return names


def mtp_layer_count(target: ModelConfig, raw: dict[str, Any]) -> tuple[str, int]:
    """The config key that counts ``target``'s MTP layers and its value in ``raw`` (0 when absent):
    ``num_nextn_predict_layers``, or for Qwen3-Next ``mtp_num_hidden_layers`` when that is not given."""
    key = "num_nextn_predict_layers"
    if target.family == QWEN3_NEXT_FAMILY and raw.get(key) is None:
        key = "mtp_num_hidden_layers"
    return key, int(raw.get(key) or 0)


def draft_layer_ids(target: ModelConfig) -> tuple[int, ...]:
    """The draft pool's layer ids of ``target``'s EAGLE draft: the MTP layer's
    (``num_hidden_layers``, planned by NEXTN) or the EAGLE head's (0, planned by EAGLE)."""
    return (0,) if target.family in EAGLE_HEAD_FAMILIES else (target.num_hidden_layers,)


def draft_algorithm(target: ModelConfig) -> str:
    """The ``speculative_algorithm`` ``target``'s EAGLE draft's cache is planned with: ``NEXTN`` for
    an MTP layer (the target's own), ``EAGLE`` for an EAGLE head (one layer of the target's layout)."""
    return "EAGLE" if target.family in EAGLE_HEAD_FAMILIES else "NEXTN"


def _where(target: ModelConfig) -> str:
    if target.family in EAGLE_HEAD_FAMILIES:
        return f"fc.* and layers.0.*, as an {EAGLE_HEAD_ARCHITECTURE} checkpoint's"
    if target.family == QWEN3_NEXT_FAMILY:
        return "mtp.*, as Qwen3-Next's"
    return f"model.layers.{target.num_hidden_layers}.*, as DeepSeek-V3's"


def nextn_params(target: ModelConfig, target_params: Any, directory: Any) -> dict[str, Any]:
    """The draft's weights: the MTP layer's from the checkpoint in ``directory`` (shapes checked
    before any data is read), the embedding and head the target's own arrays (``target_params``).

    ``ConfigError`` naming ``speculative_algorithm`` when the checkpoint has no MTP layer
    (``num_nextn_predict_layers`` 0, or its tensors missing), naming the tensor when one has
    another shape."""
    from kvjax.serve.checkpoint import SafetensorsTensors, read_config, set_param

    path, raw = read_config(directory)
    if target.family in EAGLE_HEAD_FAMILIES:
        if not is_eagle_head(path):
            raise ConfigError(
                "speculative_draft_model_path",
                str(path),
                f"a {target.family} target has no MTP layer: its EAGLE draft is a head whose config.json names "
                f"{EAGLE_HEAD_ARCHITECTURE}; give --speculative-draft-model-path such a checkpoint",
            )
    else:
        key, layers = mtp_layer_count(target, raw)
        if layers != 1:
            raise ConfigError(
                "speculative_algorithm",
                "NEXTN",
                f"{path} has {key}={layers}: kvjax drafts with exactly one MTP layer; "
                "serve a checkpoint with its MTP layer, or drop --speculative-algorithm",
            )
    names = nextn_tensor_names(target)
    shapes = dict(_flat(nextn_param_shapes(target)))
    params: dict[str, Any] = {}
    with SafetensorsTensors(path) as tensors:
        missing = [n for n in names.values() if n not in tensors]
        if missing:
            raise ConfigError(
                "speculative_algorithm",
                "NEXTN",
                f"{path} has no {_what(target)} weights ({len(missing)} tensors missing, e.g. {missing[0]!r}); "
                f"serve a checkpoint that keeps them ({_where(target)})",
            )
        for param_path, name in names.items():
            want = tuple(shapes[param_path].shape)
            if tensors.shape(name) != want:
                raise ConfigError(
                    "tensor", name, f"has shape {tensors.shape(name)} in {path} but the {_what(target)} needs {want}"
                )
        dt = jnp.dtype(target.dtype)
        for param_path, name in names.items():
            set_param(params, param_path, jnp.asarray(tensors.get(name), dtype=dt))
    return with_shared_weights(params, target, target_params)


def _what(target: ModelConfig) -> str:
    return "EAGLE head" if target.family in EAGLE_HEAD_FAMILIES else "MTP layer"


def with_shared_weights(own: dict[str, Any], target: ModelConfig, target_params: Any) -> dict[str, Any]:
    """The MTP layer's own weights ``own`` with the target's embedding (and untied head) added."""
    stack = target_params["model"]
    out = dict(own, embed_tokens=stack["embed_tokens"])
    if not target.tie_word_embeddings:
        out["lm_head"] = target_params["lm_head"]
    return out


def _flat(tree: Any) -> Any:
    from kvjax.serve.checkpoint import flatten_params

    return flatten_params(tree)


def check_draft_fits(target: ModelConfig, draft_params: Any) -> None:
    """``ConfigError`` naming ``speculative_draft_model_path`` when the draft's weights do not fit
    the target (vocabulary or hidden size, read off its shapes)."""
    shapes = {p: tuple(v.shape) for p, v in _flat(draft_params)}
    for path, want in _flat(nextn_param_shapes(target)):
        got = shapes.get(path)
        if got != tuple(want.shape):
            raise ConfigError(
                "speculative_draft_model_path",
                "/".join(path),
                f"the draft's weight has shape {got}, the target (vocab {target.vocab_size}, hidden "
                f"{target.hidden_size}) needs {tuple(want.shape)}: a draft of this target's vocabulary and hidden size",
            )


@dataclasses.dataclass(frozen=True)
class NextNDraftModel:
    """A target's MTP layer ready to draft (``kvjax.serve.generate``'s ``draft`` for EAGLE /
    NEXTN): ``params`` as `nextn_params` returns them, read from ``path``."""

    name: str
    params: dict[str, Any]
    path: Path
    algorithm: str = "NEXTN"
    """The ``speculative_algorithm`` its cache is planned with (`draft_algorithm`; ``EAGLE3``
    for an EAGLE3 draft, ``eagle3_checkpoint.load_eagle3_draft``)."""
    eagle3: Eagle3Config | None = None
    """An EAGLE3 draft's shapes and switches (None for an MTP layer or an EAGLE head)."""


def load_nextn_draft(directory: str | Path, target: Any) -> NextNDraftModel:
    """The MTP layer of the checkpoint in ``directory`` as the draft of ``target`` (a
    ``LoadedModel``; normally the same checkpoint), with the target's embedding and head.
    ``ConfigError`` naming ``speculative_draft_model_path`` for a directory that is not a
    checkpoint, or a layer that does not fit the target; as `nextn_params` otherwise."""
    from kvjax.serve.checkpoint import read_config

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise ConfigError(
            "speculative_draft_model_path",
            str(directory),
            "EAGLE / NEXTN read the MTP layer from a checkpoint directory (the target's own, by default); "
            "a preset or GGUF file has none",
        )
    config = target.config
    if config.family in EAGLE_HEAD_FAMILIES and is_eagle_head(path):
        check_head_config(config, read_config(path)[1], dict(target.spec.extra), path)
    params = nextn_params(config, target.params, path)
    check_draft_fits(config, params)
    algorithm = draft_algorithm(config)
    return NextNDraftModel(name=f"{path.name} ({_what(config)})", params=params, path=path, algorithm=algorithm)
