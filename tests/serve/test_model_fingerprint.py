"""Model fingerprints: what the storage tier keys pages by. The bytes and the config decide it;
the folder's name, place and shard layout do not."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvjax import ModelSpec
from kvjax.serve.checkpoint import load_checkpoint, save_checkpoint
from kvjax.serve.generate import resolve_model
from kvjax.serve.model import init_params
from kvjax.serve.model_fingerprint import WeightsHasher, random_weights_fingerprint

SPEC = ModelSpec.preset("tiny")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("a") / "model", SPEC, init_params(SPEC, seed=1))


def test_the_weights_and_config_decide_the_fingerprint_not_the_folder(saved, tmp_path):
    a = load_checkpoint(saved).fingerprint
    assert a.startswith("ckpt-") and len(a) == len("ckpt-") + 32
    assert load_checkpoint(saved).fingerprint == a  # deterministic
    copy = shutil.copytree(saved, tmp_path / "elsewhere")
    assert load_checkpoint(copy).fingerprint == a  # another folder, same bytes: same pages

    tensors = load_file(str(saved / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    nudged = dict(tensors)
    nudged[name] = tensors[name].copy()
    nudged[name].reshape(-1)[5] = np.nextafter(nudged[name].reshape(-1)[5], np.float32(1))  # one ulp
    one_ulp = shutil.copytree(saved, tmp_path / "one_ulp" / "model")
    save_file(nudged, str(one_ulp / "model.safetensors"))
    assert load_checkpoint(one_ulp).fingerprint != a

    eps = shutil.copytree(saved, tmp_path / "eps" / "model")
    config = json.loads((eps / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (eps / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(eps).fingerprint != a
    assert load_checkpoint(saved, dtype="bfloat16").fingerprint != a  # served in another dtype


def test_sharded_files_hash_like_one_file(saved, tmp_path):
    tensors = load_file(str(saved / "model.safetensors"))
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(saved / "config.json", sharded / "config.json")
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(sharded / file))
    weight_map = {n: file for file, part in halves.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load_checkpoint(sharded).fingerprint == load_checkpoint(saved).fingerprint


def test_random_weights_are_fingerprinted_by_config_and_seed():
    zero = random_weights_fingerprint(SPEC, 0)
    assert zero.startswith("random-") and zero == random_weights_fingerprint(SPEC, 0)
    assert zero != random_weights_fingerprint(SPEC, 1)
    assert zero != random_weights_fingerprint(ModelSpec.preset("gemma3-tiny"), 0)
    assert resolve_model("tiny").fingerprint == zero


def test_a_tensor_added_twice_is_refused():
    hasher = WeightsHasher({"model_type": "llama"}, "float32")
    hasher.add("w", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="'w' added to the fingerprint twice"):
        hasher.add("w", np.zeros(3, np.float32))
    before = hasher.hexdigest()
    hasher.add("v", np.zeros((), np.float32))
    assert hasher.hexdigest() != before
