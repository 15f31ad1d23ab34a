"""A GGUF file's model metadata as a Hugging Face ``config.json`` dictionary.

llama.cpp writes a model's hyperparameters under its architecture's prefix (``llama.block_count``,
``llama.attention.head_count_kv``, ...). kvjax reads them into the keys Transformers' config
classes use, so the rest of kvjax (``ModelSpec.from_hf_config``, the serving model) sees a GGUF
model exactly as it sees a checkpoint directory. The architectures read are ``llama`` (Llama 2
and 3, Mistral, SmolLM), ``qwen2`` and ``qwen3``; others are refused by name.

Two things GGUF says in other ways: a tied head is the absence of an ``output.weight`` tensor,
and Llama 3.1's scaled rotary frequencies are a ``rope_freqs.weight`` tensor, which kvjax does
not read (refused by name rather than served with the wrong positions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvjax.errors import ConfigError
from kvjax.gguf.reader import GGUFFile

#: GGUF architecture -> Transformers ``model_type``.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _number(metadata: Mapping[str, Any], key: str, file: GGUFFile, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if value is None:
        raise ConfigError("model", str(file.path), f"has no {key}; the GGUF file's metadata is incomplete")
    if isinstance(value, list):  # per-layer values (some converters write head counts per layer)
        if len(set(value)) != 1:
            raise ConfigError("model", str(file.path), f"{key} differs by layer ({value[:4]}...); not served")
        value = value[0]
    return value


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The ``config.json`` dictionary of ``file``'s model (float32 weights: GGUF tensors are
    dequantised to float32). Raises `ConfigError` naming an unsupported architecture, rotary
    scaling or missing hyperparameter."""
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(
            "model",
            str(file.path),
            f"has GGUF architecture {arch!r}; kvjax reads {sorted(ARCHITECTURES)} GGUF files "
            "(convert other models to a safetensors checkpoint directory)",
        )
    meta = file.metadata

    def key(name: str, default: Any = None) -> Any:
        return _number(meta, f"{arch}.{name}", file, default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise ConfigError("model", str(file.path), f"has neither {arch}.vocab_size nor a tokenizer vocabulary")
        vocab = len(tokens)
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "architectures": [f"{ARCHITECTURES[arch].capitalize()}ForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "torch_dtype": "float32",
    }
    for name, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.get(f"tokenizer.ggml.{field}")
        if isinstance(value, int):
            config[name] = value
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise ConfigError("model", str(file.path), f"uses {scaling!r} rotary scaling, which kvjax does not read")
    if "rope_freqs.weight" in file.tensors:
        raise ConfigError(
            "model",
            str(file.path),
            "carries Llama 3.1 scaled rotary frequencies (rope_freqs.weight), which kvjax does not read; "
            "serve the model's safetensors checkpoint directory instead",
        )
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config
