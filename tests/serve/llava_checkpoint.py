"""A tiny random-weight LLaVA checkpoint made with Transformers (the LLaVA tests' model).

``LlavaForConditionalGeneration`` of a CLIP vision tower (3 layers, 28-pixel images in 7-pixel
patches: 16 patches, so 16 placeholder tokens per image with the ``default`` selection) and a
2-layer Llama language model of the parity tests' sizes (``TINY_CONFIG``), float32, weights drawn
after ``torch.manual_seed(seed)`` with ``initializer_range`` 0.2 (logits of order 1), saved with
``save_pretrained``. The image placeholder is the vocabulary's last id, ``IMAGE_TOKEN``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.serve.parity_harness import TINY_CONFIG, VOCAB, save_pretrained, torch, transformers
from tests.serve.random_workloads import TINY_LAYER_SIZES

IMAGE_TOKEN = VOCAB - 1
IMAGE_SIZE = 28
PATCH = 7
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2

VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=PATCH,
    projection_dim=16,
    initializer_range=0.2,
)


def llava_config(**fields: Any) -> Any:
    """Transformers' ``LlavaConfig`` of the module docstring; ``fields`` override its top-level keys."""
    text = transformers.LlamaConfig(**TINY_CONFIG, **TINY_LAYER_SIZES, num_hidden_layers=2)
    vision = transformers.CLIPVisionConfig(**VISION)
    top = dict(image_token_id=IMAGE_TOKEN, image_seq_length=TOKENS_PER_IMAGE, initializer_range=0.2)
    top.update(fields)
    return transformers.LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), **top)


def tiny_llava(
    tmp_path_factory: pytest.TempPathFactory, name: str, *, seed: int = 0, **fields: Any
) -> tuple[Any, Path]:
    """``(hf, directory)``: the random-weight model (eval mode) and the directory it is saved in."""
    torch.manual_seed(seed)
    hf = transformers.LlavaForConditionalGeneration(llava_config(**fields)).to(torch.float32).eval()
    return hf, save_pretrained(hf, tmp_path_factory, name)


def images(n: int, seed: int = 0) -> np.ndarray:
    """``n`` random preprocessed images, float32 ``[n, 3, IMAGE_SIZE, IMAGE_SIZE]``."""
    return np.random.default_rng(seed).normal(size=(n, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)


def hf_image_features(hf: Any, pixels: np.ndarray) -> np.ndarray:
    """Transformers' ``get_image_features`` of ``pixels`` (the config's feature layer and
    selection), float32 ``[n, tokens, text hidden]``."""
    with torch.no_grad():
        out = hf.model.get_image_features(
            pixel_values=torch.tensor(pixels),
            vision_feature_layer=hf.config.vision_feature_layer,
            vision_feature_select_strategy=hf.config.vision_feature_select_strategy,
        )
    return np.stack([f.numpy() for f in out.pooler_output])
