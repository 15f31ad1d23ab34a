"""Write GGUF files for the tests the way llama.cpp's converter writes them.

`write_gguf` takes Hugging Face-named float32 tensors and a ``config.json`` dictionary and writes
a GGUF file with the ``gguf`` package's writer: the hyperparameters under the architecture's
prefix, a small byte-level BPE tokenizer (`tiny_vocabulary`, with control tokens and a chat
template), and every tensor under llama.cpp's name, stored in ``tensor_type`` (quantised by
``gguf.quants``; norms stay F32, as the converter keeps 1-D tensors), the ``llama``
architecture's query/key rows permuted as the converter does (`permute_rotary_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="GGUF tests need the gguf package (the test extra)")

from kvjax.gguf.tensors import hf_name  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token_types, merges)`` of a byte-level BPE vocabulary of ``size`` tokens: three
    control tokens, the 256 byte symbols (GPT-2's byte-to-unicode spelling) when ``size`` allows,
    then merged pairs of letters, each with its merge rule."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    letters = sorted(alphabet)
    tokens += letters[: max(0, size - len(tokens))]
    merges: list[str] = []
    pairs = [(a, b) for a in "etaoin" for b in "etaoinsr"]
    for a, b in pairs:
        if len(tokens) >= size:
            break
        if a in alphabet and b in alphabet:
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    types = [3, 3, 3] + [1] * (size - 3)
    return tokens, types, merges


def permute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row permutation of a query/key projection (two halves of each head
    interleaved in pairs)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _gguf_names() -> dict[str, str]:
    """Hugging Face name -> llama.cpp name, for a model of up to 64 layers."""
    top = ["token_embd.weight", "output_norm.weight", "output.weight"]
    parts = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"]
    parts += ["ffn_gate", "ffn_up", "ffn_down"]
    names = {hf_name(n): n for n in top}
    for layer in range(64):
        for part in parts:
            for kind in ("weight", "bias"):
                gguf_name = f"blk.{layer}.{part}.{kind}"
                names[hf_name(gguf_name)] = gguf_name
    return {k: v for k, v in names.items() if k is not None}


def write_gguf(
    path: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    tensor_type: str = "F32",
    architecture: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    vocab_size: int | None = None,
    chat_template: str | None = CHAT_TEMPLATE,
) -> Path:
    """Write ``tensors`` (Hugging Face names, float32) of the model ``config`` describes into the
    GGUF file ``path`` (see the module docstring); ``metadata``: extra or replaced keys (a value
    of None drops the key)."""
    arch = architecture or str(config["model_type"])
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    vocab = vocab_size or int(config["vocab_size"])
    fields: dict[str, Any] = {
        "general.name": "tiny test model",
        f"{arch}.block_count": int(config["num_hidden_layers"]),
        f"{arch}.context_length": int(config["max_position_embeddings"]),
        f"{arch}.embedding_length": int(config["hidden_size"]),
        f"{arch}.feed_forward_length": int(config["intermediate_size"]),
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.rope.freq_base": float(config.get("rope_theta", 10000.0)),
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.vocab_size": vocab,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": chat_template,
    }
    fields.update(metadata or {})
    tokens, types, merges = tiny_vocabulary(vocab)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, value in fields.items():
        if value is None or key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, str(value))
    names = _gguf_names()
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, value in tensors.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        array = np.asarray(value, dtype=np.float32)
        gguf_name = names.get(name, name)
        if arch == "llama" and ".attn_q." in gguf_name:
            array = permute_rotary_rows(array, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            array = permute_rotary_rows(array, kv_heads)
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
