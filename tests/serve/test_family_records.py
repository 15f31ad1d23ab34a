"""The family records: one per ``model_type``, read by the plan side and the serving side alike, and
every served model built on the shared causal-LM skeleton with Hugging Face's parameter names."""

from __future__ import annotations

import jax
import pytest

from kvjax import ModelSpec
from kvjax.errors import ConfigError
from kvjax.hf import ARCHITECTURE_TYPES, PARSERS
from kvjax.hf.families import FAMILY_RECORDS
from kvjax.serve.causal_lm import CausalLM
from kvjax.serve.families import FAMILIES, family
from kvjax.serve.model import param_shapes
from kvjax.serve.model_config import model_config_from_spec


def test_one_record_per_model_type_and_architecture():
    names = [record.name for record in FAMILY_RECORDS]
    assert len(names) == len(set(names))
    architectures = [a for record in FAMILY_RECORDS for a in record.architectures]
    assert len(architectures) == len(set(architectures))
    assert dict(PARSERS) == {record.name: record.parse for record in FAMILY_RECORDS}
    assert set(ARCHITECTURE_TYPES) == set(architectures)
    assert set(FAMILIES) == {record.name for record in FAMILY_RECORDS if record.servable}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_servable_record_names_importable_pieces(name):
    entry = family(name)
    assert issubclass(entry.load("model"), CausalLM)
    for what in ("read_config", "trace_state"):
        if getattr(entry, what) is not None:
            assert callable(entry.load(what))


def test_a_planned_only_family_is_refused_for_serving_by_name():
    assert "mixtral" in PARSERS
    with pytest.raises(ConfigError, match="model_type='mixtral'"):
        family("mixtral")


def _paths(spec: ModelSpec) -> set[str]:
    shapes = param_shapes(model_config_from_spec(spec))
    return {"/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}


def test_the_skeleton_keeps_hugging_face_names_tied_or_not():
    spec = ModelSpec.preset("tiny")
    paths = _paths(spec)
    assert {"model/embed_tokens/weight", "model/norm/weight", "model/layers_0/mlp/up_proj/weight"} <= paths
    tied = "lm_head/weight" not in paths
    assert tied == bool(spec.extra.get("tie_word_embeddings", False))
    flipped = ModelSpec.from_hf_config({**spec.extra, "tie_word_embeddings": not tied}, name="flipped")
    assert ("lm_head/weight" in _paths(flipped)) == tied
