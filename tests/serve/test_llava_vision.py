"""LLaVA's vision side (CLIP tower + projector) loaded from a Transformers checkpoint equals
Transformers' ``get_image_features`` within float32 tolerance; unsupported settings are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.errors import ConfigError
from kvjax.serve.families.llava import LlavaSettings
from kvjax.serve.image_encoder import load_image_encoder
from tests.serve.llava_checkpoint import TOKENS_PER_IMAGE, hf_image_features, images, tiny_llava

ATOL = 1e-5


@pytest.mark.parametrize(
    ("name", "fields", "tokens"),
    [
        ("default", {}, TOKENS_PER_IMAGE),
        ("last_full", dict(vision_feature_layer=-1, vision_feature_select_strategy="full"), TOKENS_PER_IMAGE + 1),
        ("first_tanh", dict(vision_feature_layer=1, projector_hidden_act="gelu_pytorch_tanh"), TOKENS_PER_IMAGE),
    ],
)
def test_image_features_equal_transformers(tmp_path_factory, name, fields, tokens):
    hf, directory = tiny_llava(tmp_path_factory, f"llava_{name}", **fields)
    encoder = load_image_encoder(directory)
    pixels = images(3)
    ours = encoder(pixels)
    ref = hf_image_features(hf, pixels)
    assert ours.shape == ref.shape == (3, tokens, hf.config.text_config.hidden_size)
    assert encoder.tokens_per_image == tokens
    assert float(np.abs(ref).max()) > 0.1  # not a trivially small output
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)
    assert (encoder.runs, encoder.images_encoded) == (1, 3)


def test_refusals(tmp_path_factory):
    _, directory = tiny_llava(tmp_path_factory, "llava_refusals")
    raw = json.loads((directory / "config.json").read_text())
    with pytest.raises(ConfigError, match="vision_config.model_type='siglip_vision_model'.*CLIP"):
        LlavaSettings.from_config(
            {**raw, "vision_config": {**raw["vision_config"], "model_type": "siglip_vision_model"}}
        )
    with pytest.raises(ConfigError, match="vision_feature_layer=\\[-2, -1\\].*one feature layer"):
        LlavaSettings.from_config({**raw, "vision_feature_layer": [-2, -1]})
    with pytest.raises(ConfigError, match="vision_feature_layer=9"):
        LlavaSettings.from_config({**raw, "vision_feature_layer": 9})
    encoder = load_image_encoder(directory)
    with pytest.raises(ValueError, match=r"pixel_values of shape \(1, 3, 32, 32\)"):
        encoder(np.zeros((1, 3, 32, 32), np.float32))
    assert encoder.runs == 0


def test_the_fingerprint_covers_the_vision_weights(tmp_path_factory, tmp_path):
    """Two checkpoints that differ only in a vision tensor have different fingerprints (the storage
    tier keys pages by it, and the image positions' KV depends on the vision weights)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from kvjax.serve.checkpoint import load_checkpoint

    _, directory = tiny_llava(tmp_path_factory, "llava_fingerprint")
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    tensors = load_file(str(other / "model.safetensors"))
    name = next(n for n in sorted(tensors) if "class_embedding" in n)
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    first, second = load_checkpoint(directory), load_checkpoint(other)
    assert first.fingerprint != second.fingerprint
    assert load_checkpoint(directory).fingerprint == first.fingerprint
