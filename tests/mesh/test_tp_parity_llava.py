"""LLaVA served tensor-parallel (tp 2, CPU devices) with images matches Transformers: the rounds of
``tests/serve/test_parity_llava`` (an image repeated, two images behind the same text, images split
by chunked prefill) at page size 16, the pools and the language model's weights split over the
mesh; the image encoder runs on the host's default device, its rows replicated into the step."""

from __future__ import annotations

import pytest

from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve.test_parity_llava import assert_matches, serve_rounds

TP = 2


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from kvjax.serve.checkpoint import load_checkpoint
    from kvjax.serve.image_encoder import load_image_encoder
    from tests.serve.llava_checkpoint import tiny_llava

    hf, directory = tiny_llava(tmp_path_factory, "llava_tp", seed=1)
    return hf, load_checkpoint(directory), load_image_encoder(directory)


def test_llava_over_tp2(llava):
    hf, model, encoder = llava
    before = encoder.images_encoded
    sched, _, done = serve_rounds(model, encoder, page_size=16, mesh=mesh_of(TP), tp_size=TP)
    assert_sharded(sched, TP)
    assert encoder.images_encoded - before == 2
    assert_matches(hf, done)
