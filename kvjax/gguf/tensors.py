"""A GGUF file's tensors under Hugging Face's names, dequantised to float32.

Names: llama.cpp's ``blk.N.attn_q.weight`` is Transformers' ``model.layers.N.self_attn.q_proj.weight``
(`hf_name`); every tensor of the file must have a name kvjax knows, so that a file of a layout kvjax
does not serve is refused by the tensor's name rather than served with a part missing.

Values: the stored blocks are dequantised by the ``gguf`` package (``gguf.quants.dequantize``),
for the types in `DEQUANTISED` (the float types and the 32-value block quantisations); other
types (K-quants, IQ types) are refused by name. A row of a stored tensor is ``ne0`` values, so
the result is already in Transformers' ``(out_features, in_features)`` order.

llama.cpp's converter permutes the rows of a ``llama`` model's query and key projections (its
rotary kernel pairs neighbouring dimensions, Transformers' pairs the two halves of a head);
`hf_tensor` undoes it (`unpermute_rotary_rows`), as Transformers' own GGUF loader does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from kvjax.errors import ConfigError
from kvjax.gguf.reader import GGUFFile

#: ggml types dequantised (through the ``gguf`` package; F32 is read as it is).
DEQUANTISED = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """Transformers' name of a GGUF tensor, or None for a name kvjax does not map."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    match = _BLOCK_NAME.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK[part]}.{kind}"


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a query/key projection of ``heads`` heads: within each
    head, rows ``(d, 2)``-interleaved go back to ``(2, d)`` halves. The inverse of the converter's
    ``reshape(heads, 2, d, ...).swapaxes(1, 2)``."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of pairs")
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantize() -> object:
    try:
        from gguf.quants import dequantize
    except ImportError:
        raise ConfigError(
            "model", "gguf", "reading GGUF weights needs the gguf package: pip install 'kvjax[gguf]'"
        ) from None
    return dequantize


class GGUFTensors:
    """The tensors of ``file`` by Transformers' name (``names``, ``shape``, ``get``).

    ``heads`` and ``kv_heads`` are the model's query and key/value head counts, which the
    ``llama`` architecture's query/key rows are un-permuted by. Construction checks every name
    and type (`ConfigError` naming the first tensor kvjax cannot read); ``get`` dequantises.
    """

    def __init__(self, file: GGUFFile, *, heads: int, kv_heads: int) -> None:
        self.file, self.heads, self.kv_heads = file, heads, kv_heads
        self._by_hf: dict[str, str] = {}
        for name, info in file.tensors.items():
            mapped = hf_name(name)
            if mapped is None:
                raise ConfigError(
                    "tensor", name, f"in {file.path.name} is not a tensor of the {file.architecture} layout kvjax reads"
                )
            if info.type_name not in DEQUANTISED:
                raise ConfigError(
                    "tensor",
                    name,
                    f"in {file.path.name} is stored as {info.type_name}; kvjax dequantises {', '.join(DEQUANTISED)} "
                    "(requantise the file with one of those, e.g. llama.cpp's llama-quantize ... Q8_0)",
                )
            self._by_hf[mapped] = name

    def names(self) -> Iterator[str]:
        """Transformers' names of every tensor in the file."""
        return iter(self._by_hf)

    def __contains__(self, name: str) -> bool:
        return name in self._by_hf

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape (Transformers' order), read from the directory without data."""
        return self.file.tensors[self._by_hf[name]].shape

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32, dequantised and (llama's q/k) un-permuted."""
        gguf_name = self._by_hf[name]
        info = self.file.tensors[gguf_name]
        raw = self.file.raw(gguf_name)
        if info.type_name == "F32":
            values = raw.view(np.float32)
        else:
            from gguf.constants import GGMLQuantizationType

            values = _dequantize()(np.asarray(raw), GGMLQuantizationType(info.type_id))  # type: ignore[operator]
        values = np.asarray(values, dtype=np.float32).reshape(info.shape)
        if self.file.architecture == "llama":
            if ".attn_q." in gguf_name:
                values = unpermute_rotary_rows(values, self.heads)
            elif ".attn_k." in gguf_name:
                values = unpermute_rotary_rows(values, self.kv_heads)
        return values
