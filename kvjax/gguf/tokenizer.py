"""The tokenizer a GGUF file describes, built as a ``tokenizers.Tokenizer``.

GGUF stores a byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) as its vocabulary
(``tokenizer.ggml.tokens``, id order), its merges, each token's type (3: control, 4:
user-defined) and the name of the pre-tokenizer its merges were learned with
(``tokenizer.ggml.pre``). kvjax rebuilds what the model's own ``tokenizer.json`` would say:

* the byte-level BPE model over that vocabulary and those merges, the byte-level decoder;
* the text split that llama.cpp uses for that ``pre`` name (`PRE_TOKENIZERS`): GPT-2's regex by
  default, digits one by one before it for ``smollm`` (SmolLM's ``tokenizer.json`` says the same),
  Llama 3's and Qwen 2's regexes for theirs;
* control tokens as special tokens (``<|im_start|>`` in a chat prompt is one token, and is
  skipped when decoding), user-defined ones as added tokens; a BOS token first when
  ``tokenizer.ggml.add_bos_token`` says so.

SentencePiece files (``"llama"``) and unknown ``pre`` names are refused by name: serving with a
different split would change the prompt's ids without a sign. Text is not needed to serve the
model (``--prompt-ids`` works without it).
"""

from __future__ import annotations

from typing import Any

from kvjax.errors import ConfigError
from kvjax.gguf.reader import GGUFFile

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` -> the splits applied in order before the byte-level step (``"digits"``:
#: every digit on its own).
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt-2": (_GPT2,),
    "smollm": ("digits", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
}
CONTROL, USER_DEFINED = 3, 4


def build_tokenizer(file: GGUFFile) -> Any:
    """A ``tokenizers.Tokenizer`` for ``file``'s vocabulary (see the module docstring); a
    `ConfigError` for a file without a byte-level BPE tokenizer or with an unknown split."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    meta = file.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            "model",
            str(file.path),
            f"has a {kind!r} tokenizer; kvjax builds byte-level BPE ('gpt2') tokenizers from GGUF, "
            "pass token ids with --prompt-ids",
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(
            "model",
            str(file.path),
            f"splits text with the {pre!r} pre-tokenizer, which kvjax does not know (it knows "
            f"{sorted(PRE_TOKENIZERS)}); pass token ids with --prompt-ids",
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(
        models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    )
    steps: list[Any] = []
    for split in PRE_TOKENIZERS[pre]:
        if split == "digits":
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        else:
            steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind_ in zip(tokens, types, strict=False)
            if kind_ == CONTROL
        ]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False) for t, kind_ in zip(tokens, types, strict=False) if kind_ == USER_DEFINED]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and isinstance(bos, int):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return tokenizer


def special_token(file: GGUFFile, which: str) -> str | None:
    """The text of ``tokenizer.ggml.{which}_token_id`` (``bos``, ``eos``), or None."""
    index = file.metadata.get(f"tokenizer.ggml.{which}_token_id")
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(index, int) or not isinstance(tokens, list) or not 0 <= index < len(tokens):
        return None
    return tokens[index]
