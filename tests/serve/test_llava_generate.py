"""``generate --image``: image files preprocessed as the checkpoint's ``preprocessor_config.json``
says (equal to Transformers' CLIP image processor), served end to end with the embedding cache's
counters in the result, and one ``error:`` line for each bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvjax.cli import main
from kvjax.serve.image_files import ImagePreprocessing, read_image
from tests.serve.llava_checkpoint import IMAGE_SIZE, IMAGE_TOKEN, TOKENS_PER_IMAGE, tiny_llava
from tests.serve.parity_harness import torch, transformers

Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf, directory = tiny_llava(tmp_path_factory, "llava_generate", seed=1)
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor.save_pretrained(directory)
    files = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(2)
    paths = []
    for i, (h, w, mode) in enumerate([(40, 57, "RGB"), (61, 33, "RGBA")]):
        pixels = (rng.random((h, w, len(mode))) * 255).astype(np.uint8)
        path = files / f"image{i}.png"
        Image.fromarray(pixels, mode).save(path)
        paths.append(path)
    (files / "broken.png").write_bytes(b"not an image")
    return hf, processor, directory, paths, files / "broken.png"


def test_preprocessing_equals_transformers(checkpoint):
    _, processor, directory, paths, _ = checkpoint
    prep = ImagePreprocessing.from_directory(directory, IMAGE_SIZE)
    for path in paths:
        ours = read_image(path, prep)
        ref = processor(images=Image.open(path), return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)


def test_generate_with_images(checkpoint, capsys):
    hf, processor, directory, paths, _ = checkpoint
    text = [3, 17, 42]
    # Prompt 1 names its image with one placeholder (expanded), prompt 2 repeats it and names another.
    p1 = [*text, IMAGE_TOKEN, 5, 9]
    p2 = [*text, IMAGE_TOKEN, 5, 9, *[IMAGE_TOKEN] * TOKENS_PER_IMAGE, 11]
    argv = ["generate", "--model", str(directory), "--max-new-tokens", "3", "--ignore-eos", "--json"]
    argv += ["--prompt-ids", ",".join(map(str, p1)), "--prompt-ids", ",".join(map(str, p2))]
    argv += ["--image", str(paths[0]), "--image", str(paths[0]), "--image", str(paths[1])]
    argv += ["--vlm-cache-size-mb", "1", "--page-size", "1"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    mm = report["multimodal"]
    assert mm["images_encoded"] == 2 and mm["max_bytes"] == 1 << 20  # image 0 encoded once
    assert report["cached_tokens"] >= len(text) + TOKENS_PER_IMAGE + 2  # prompt 2 reuses prompt 1's KV
    pixels = np.stack([processor(images=Image.open(p), return_tensors="np")["pixel_values"][0] for p in paths])
    expanded = [*text, *[IMAGE_TOKEN] * TOKENS_PER_IMAGE, 5, 9]
    for prompt, images, output in (
        (expanded, pixels[[0]], report["outputs"][0]),
        ([*expanded, *[IMAGE_TOKEN] * TOKENS_PER_IMAGE, 11], pixels[[0, 1]], report["outputs"][1]),
    ):
        with torch.no_grad():
            ref = hf.generate(
                input_ids=torch.tensor([prompt]), pixel_values=torch.tensor(images), max_new_tokens=3, do_sample=False
            )
        assert output == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("broken", "--image .*broken.png.*cannot be read as an image"),
        ("count", "--image given 2 times: the prompts name 1 image"),
        ("tower", "vision_config.model_type='siglip_vision_model'.*CLIP"),
    ],
)
def test_bad_input_is_one_error_line(checkpoint, tmp_path, capsys, case, expect):
    _, _, directory, paths, broken = checkpoint
    model = directory
    images = [str(paths[0])]
    if case == "broken":
        images = [str(broken)]
    elif case == "count":
        images = [str(paths[0]), str(paths[1])]
    elif case == "tower":
        model = tmp_path / "siglip"
        model.mkdir()
        raw = json.loads((directory / "config.json").read_text())
        raw["vision_config"]["model_type"] = "siglip_vision_model"
        (model / "config.json").write_text(json.dumps(raw))
    argv = ["generate", "--model", str(model), "--prompt-ids", f"1,2,{IMAGE_TOKEN},3", "--max-new-tokens", "2"]
    for image in images:
        argv += ["--image", image]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err
    assert re.search(expect, err[0]), err[0]
