"""Checkpoint directories: both config layouts read alike, a saved model loads back exactly, and
every kind of bad input is one clear error line with exit status 2 (through ``kvjax.cli.main``)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvjax import ModelSpec
from kvjax.cli import main
from kvjax.errors import ConfigError
from kvjax.serve.checkpoint import load_checkpoint, save_checkpoint
from kvjax.serve.model import init_params
from kvjax.serve.model_config import RopeConfig, read_rope

OLD_LLAMA3 = {
    "rope_theta": 500000.0,
    "rope_scaling": {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
NEW_LLAMA3 = {
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
}


def test_old_and_new_config_layouts_read_the_same_rope():
    old, new = read_rope(OLD_LLAMA3), read_rope(NEW_LLAMA3)
    assert old == new == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0)
    freqs = new.inverse_frequencies(128)
    base = RopeConfig(theta=500000.0).inverse_frequencies(128)
    assert freqs[0] == base[0], "short wavelengths are kept"
    assert freqs[-1] == pytest.approx(base[-1] / 8.0), "long wavelengths are divided by the factor"
    assert read_rope({}) == RopeConfig()
    assert read_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).theta == 1e6


def test_unsupported_rope_type_is_named():
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        read_rope({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny preset's seed-0 weights saved as a checkpoint directory (config.json + model.safetensors)."""
    spec = ModelSpec.preset("tiny")
    return save_checkpoint(tmp_path_factory.mktemp("tiny"), spec, init_params(spec))


def test_a_saved_checkpoint_loads_back_exactly_and_in_a_dtype_override(tiny_dir):
    spec = ModelSpec.preset("tiny")
    model = load_checkpoint(tiny_dir)
    assert model.spec.dtype == "float32" and model.config.family == "llama"
    expected = jax.tree_util.tree_leaves_with_path(init_params(spec))
    loaded = dict(jax.tree_util.tree_leaves_with_path(model.params))
    assert len(loaded) == len(expected)
    for path, value in expected:
        np.testing.assert_array_equal(np.asarray(loaded[path]), np.asarray(value))
    half = load_checkpoint(tiny_dir, dtype="bfloat16")
    assert half.spec.dtype == "bfloat16"
    assert {str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(half.params)} == {"bfloat16"}


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_error_line(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_generate_from_the_directory_matches_the_preset_and_prints_json(tiny_dir, capsys):
    argv = ["--prompt-ids", "1,2,3,4,5", "--prompt-ids", "1,2,3,4,5,6,7", "--max-new-tokens", "3", "--json"]
    code, out, _ = _run(["generate", "--model", str(tiny_dir), *argv], capsys)
    assert code == 0
    from_dir = json.loads(out)
    code, out, _ = _run(["generate", "--model", "tiny", *argv], capsys)
    assert code == 0
    assert json.loads(out) == from_dir
    assert set(from_dir) == {"outputs", "cached_tokens", "prompt_tokens"}
    assert from_dir["prompt_tokens"] == 12 and len(from_dir["outputs"]) == 2
    assert all(len(o) == 3 for o in from_dir["outputs"])
    code, out, _ = _run(["generate", "--model", "tiny", *argv, "--disable-overlap-schedule"], capsys)
    assert code == 0 and json.loads(out) == from_dir  # the same tokens without overlap scheduling


def test_generate_reuses_an_earlier_prompt_and_decodes_text_with_a_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    spec = ModelSpec.preset("tiny")
    directory = save_checkpoint(tmp_path / "tok", spec, init_params(spec))
    words = [f"w{i}" for i in range(spec.vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    system = " ".join(words[10:30])
    code, out, _ = _run(
        [
            "generate",
            "--model",
            str(directory),
            "--prompt",
            f"{system} w1 w2",
            "--prompt",
            f"{system} w3",
            "--max-new-tokens",
            "2",
            "--page-size",
            "4",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    result = json.loads(out)
    assert result["prompt_tokens"] == 22 + 21
    assert result["cached_tokens"] == 20, "the second prompt reuses the first one's 20-token prefix (5 pages)"


def test_directory_without_config_json(tmp_path, capsys):
    code, _, err = _run(["generate", "--model", str(tmp_path), "--prompt-ids", "1"], capsys)
    _assert_one_error_line(code, err, "config.json")


def test_directory_without_weights(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(ModelSpec.preset("tiny").extra)))
    code, _, err = _run(["generate", "--model", str(tmp_path), "--prompt-ids", "1"], capsys)
    _assert_one_error_line(code, err, "safetensors")


def test_a_family_kvjax_cannot_serve(tmp_path, capsys):
    config = dict(ModelSpec.preset("gemma-2-9b").extra)
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = _run(["generate", "--model", str(tmp_path), "--prompt-ids", "1"], capsys)
    _assert_one_error_line(code, err, "gemma2", "llama")


def _tampered(tmp_path, tiny_dir, change) -> tuple:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text((tiny_dir / "config.json").read_text())
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory, sorted(p.name for p in directory.iterdir())


def test_a_missing_tensor_is_named(tmp_path, tiny_dir, capsys):
    directory, files = _tampered(tmp_path, tiny_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    code, _, err = _run(["generate", "--model", str(directory), "--prompt-ids", "1"], capsys)
    _assert_one_error_line(code, err, "model.layers.1.mlp.up_proj.weight", "missing", "(128, 64)")
    assert sorted(p.name for p in directory.iterdir()) == files, "nothing is written next to the checkpoint"


def test_a_mis_shaped_tensor_names_both_shapes(tmp_path, tiny_dir, capsys):
    def reshape(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)

    directory, _ = _tampered(tmp_path, tiny_dir, reshape)
    code, _, err = _run(["generate", "--model", str(directory), "--prompt-ids", "1"], capsys)
    _assert_one_error_line(code, err, "model.layers.0.self_attn.k_proj.weight", "(16, 64)", "(32, 64)")


def test_prompt_text_without_a_tokenizer(tiny_dir, capsys):
    code, _, err = _run(["generate", "--model", str(tiny_dir), "--prompt", "hello"], capsys)
    _assert_one_error_line(code, err, "tokenizer.json", "--prompt-ids")


def test_prompt_ids_outside_the_vocabulary(tiny_dir, capsys):
    code, _, err = _run(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,256,2"], capsys)
    _assert_one_error_line(code, err, "256", "[0, 256)")
    code, _, err = _run(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,-3"], capsys)
    _assert_one_error_line(code, err, "-3")
    code, _, err = _run(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,x"], capsys)
    _assert_one_error_line(code, err, "comma-separated")


def test_a_model_that_is_neither_a_directory_nor_a_preset(capsys):
    code, _, err = _run(["generate", "--model", "no-such-model", "--prompt-ids", "1"], capsys)
    _assert_one_error_line(code, err, "no-such-model", "preset")
