"""Images on the request wire (``WireImage``, ``RequestSpec.images``): a request made by a
``MultimodalExtension`` travels with its unpadded prompt and pixels and is made again, equal,
by another process's extension; decoding refuses a bad image field naming it; a request with
images that cannot travel is refused before anything is sent."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.multihost import wire
from kvjax.multihost.channel import LoopbackChannel
from kvjax.multihost.errors import DivergenceError
from kvjax.multimodal import EmbeddingCache
from kvjax.multimodal.pad_values import is_pad_value
from kvjax.serve.multihost.front import MultiProcessFront
from kvjax.serve.multihost.request_broadcast import REQUEST_VERSION, RequestSpec, StepMessage, WireImage
from kvjax.serve.multimodal_extension import MultimodalExtension
from kvjax.serve.serving_req import ServingReq

PLACEHOLDER = 7
SHAPE = (3, 2, 2)


class FakeEncoder:
    """Two rows per image, of hidden size 4 (never run here: nothing is prefilled)."""

    tokens_per_image = 2
    hidden_size = 4

    def __call__(self, pixel_values: np.ndarray) -> np.ndarray:
        return np.zeros((len(pixel_values), 2, 4), np.float32)


def extension(preprocessing: dict | None = None) -> MultimodalExtension:
    return MultimodalExtension(
        FakeEncoder(),
        EmbeddingCache(1 << 20),
        placeholder_token_id=PLACEHOLDER,
        vocab_size=100,
        image_shape=SHAPE,
        preprocessing=preprocessing if preprocessing is not None else {"size": 2},
    )


def image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


PROMPT = [1, PLACEHOLDER, PLACEHOLDER, 3, PLACEHOLDER, PLACEHOLDER, 4]


def image_request(ext: MultimodalExtension, rid: str = "v") -> ServingReq:
    return ext.request(
        rid, PROMPT, [image(0), image(1)], max_new_tokens=3, extra_key="t", stop_token_ids=[2], priority=1
    )


def test_a_wire_image_round_trips_exactly():
    for pixels in (image(3), np.arange(12, dtype=">i4").reshape(SHAPE), np.arange(6, dtype=np.uint8)[::2]):
        sent = WireImage.of(pixels, 2**64 - 1)
        got = wire.decode(wire.encode(sent), WireImage)
        assert got == sent and got.item_hash == 2**64 - 1
        np.testing.assert_array_equal(got.array(), pixels)
        assert got.array().dtype == pixels.dtype.newbyteorder("=") and got.array().flags.writeable


def test_a_request_with_images_travels_and_is_made_again_equal():
    here, there = extension(), extension()
    req = image_request(here)
    spec = RequestSpec.of(req, here)
    assert list(spec.prompt) == PROMPT  # unpadded: the receiving extension pads it again
    assert [im.dtype for im in spec.images] == ["float32", "float32"]
    raw = StepMessage(4, (spec,)).encode()
    assert json.loads(raw)["fields"]["requests"][0]["version"] == REQUEST_VERSION
    got = StepMessage.decode(raw).requests[0].build(there)
    assert list(got.origin_input_ids) == list(req.origin_input_ids)
    assert any(is_pad_value(t) for t in got.origin_input_ids)
    assert there.items(got) == here.items(req) and there.registered == 1
    held_here, held_there = here.request_images(req), there.request_images(got)
    assert held_here is not None and held_there is not None
    assert held_here[0] == held_there[0] == PROMPT
    for a, b in zip(held_here[1], held_there[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert (got.rid, got.max_new_tokens, got.extra_key) == ("v", 3, "t")
    assert (got.stop_token_ids, got.priority) == (frozenset({2}), 1)


def test_a_text_request_of_the_extension_travels_without_images():
    ext = extension()
    req = ext.request("t", [1, 2, 3], [], max_new_tokens=2)
    spec = RequestSpec.of(req, ext)
    assert spec.images == () and spec.prompt == (1, 2, 3)
    assert list(spec.build(extension()).origin_input_ids) == [1, 2, 3]


def test_other_preprocessing_is_refused_by_the_receiver_naming_both_hashes():
    here, there = extension(), extension({"size": 3})
    spec = RequestSpec.of(image_request(here), here)
    with pytest.raises(ValueError, match=r"request 'v' image 0: process 0 hashed it 0x[0-9a-f]+, this process 0x"):
        spec.build(there)
    assert there.registered == 0
    with pytest.raises(ValueError, match=r"arrived with 2 images but .* no MultimodalExtension"):
        spec.build(None)


def test_images_that_cannot_travel_are_refused_before_sending():
    here = extension()
    req = image_request(here)
    with pytest.raises(ValueError, match=r"request 'v' carries images .* the scheduler has no MultimodalExtension"):
        RequestSpec.of(req)
    with pytest.raises(ValueError, match=r"request 'v' carries images .* MultimodalExtension did not make it"):
        RequestSpec.of(req, extension())
    assert here.registered == 1  # nothing changed


def test_discard_drops_a_request_s_images_only():
    ext = extension()
    a, b = image_request(ext, "a"), image_request(ext, "b")
    ext.discard(a)
    ext.discard(ServingReq("c", [1], max_new_tokens=1))
    assert ext.request_images(a) is None and ext.request_images(b) is not None and ext.registered == 1


def with_image(**fields: object) -> dict:
    """A step message's JSON (one request with one image), its image's fields altered."""
    spec = RequestSpec("r", (1, PLACEHOLDER, PLACEHOLDER), 2, images=(WireImage.of(image(0), 5),))
    obj = json.loads(StepMessage(1, (spec,)).encode())
    obj["fields"]["requests"][0]["fields"]["images"][0]["fields"].update(fields)
    return obj


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"dtype": "bfloat16"}, r"dtype='bfloat16': an image travels as one of float16, float32"),
        ({"dtype": "object"}, "dtype='object'"),
        ({"shape": [3, 2, 3]}, r"data: 48 bytes, but shape \(3, 2, 3\) of float32 needs 72"),
        ({"dtype": "float64"}, r"data: 48 bytes, but shape \(3, 2, 2\) of float64 needs 96"),
        ({"shape": [3, 0, 2]}, r"shape=\(3, 0, 2\): give at least one dimension, each >= 1"),
        ({"shape": []}, "shape=()"),
        ({"data": "not base64!"}, "data: not base64"),
        ({"data": "\u00e9AAA"}, "data: not base64"),
        ({"item_hash": 2**64}, r"item_hash=18446744073709551616: a content hash is an int in \[0, 2\*\*64\)"),
        ({"item_hash": -1}, "item_hash=-1"),
    ],
)
def test_decoding_refuses_a_bad_image_naming_it(fields, says):
    with pytest.raises(wire.WireError, match=f"refused by WireImage: {says}") as e:
        StepMessage.decode(json.dumps(with_image(**fields)).encode())
    assert e.value.where == "StepMessage.requests[0].images[0]"


def test_decoding_refuses_a_mistyped_image_field():
    with pytest.raises(wire.WireError, match="expected int, got str") as e:
        StepMessage.decode(json.dumps(with_image(item_hash="5")).encode())
    assert e.value.where == "StepMessage.requests[0].images[0].item_hash"


def test_pixels_of_another_dtype_cannot_travel():
    with pytest.raises(ValueError, match="pixels of dtype complex64: an image travels as one of"):
        WireImage.of(np.zeros(SHAPE, np.complex64), 1)


class FakeScheduler:
    """What the front uses of a scheduler, recording what it is given."""

    idle = True

    def __init__(self, *extensions: object) -> None:
        self.extensions = extensions
        self.finished: list[ServingReq] = []
        self.submitted: list[ServingReq] = []

    def check_servable(self, reqs: list[ServingReq]) -> None:
        pass

    def submit(self, reqs: list[ServingReq]) -> None:
        self.submitted.extend(reqs)


class Recording(LoopbackChannel):
    """Process 0 alone, keeping what it sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]:
        self.sent.append(payload)
        return super().all_gather(tag, payload)


class Receiving:
    """Process 1 of two, receiving what a `Recording` process 0 sent, in order."""

    process_id = 1
    num_processes = 2

    def __init__(self, sent: list[bytes]) -> None:
        self.sent = sent

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]:
        return [self.sent.pop(0), payload]


def test_the_front_sends_images_and_the_other_process_makes_the_same_request():
    ext0, ext1 = extension(), extension()
    sched0, sched1 = FakeScheduler(object(), ext0), FakeScheduler(ext1)
    channel = Recording()
    front0 = MultiProcessFront(sched0, channel)
    front1 = MultiProcessFront(sched1, Receiving(channel.sent))  # type: ignore[arg-type]
    assert front0.multimodal is ext0 and front1.multimodal is ext1
    front0.submit([image_request(ext0), ServingReq("t", [1, 2], max_new_tokens=1)])
    front1.submit([image_request(ext1)])  # the same driver runs everywhere: ignored, its images dropped
    assert front1.ignored_submissions == 1 and ext1.registered == 0
    assert front0.idle and front1.idle
    (a0, _), (a1, t1) = sched0.submitted, sched1.submitted
    assert list(a1.origin_input_ids) == list(a0.origin_input_ids) and ext1.items(a1) == ext0.items(a0)
    assert ext1.registered == 1 and list(t1.origin_input_ids) == [1, 2]


def test_the_front_refuses_images_without_an_extension_before_sending():
    channel = Recording()
    front = MultiProcessFront(FakeScheduler(), channel)
    assert front.multimodal is None
    with pytest.raises(ValueError, match=r"request 'v' carries images .* the scheduler has no MultimodalExtension"):
        front.submit([ServingReq("ok", [1], max_new_tokens=1), image_request(extension())])
    assert front.idle and channel.sent == [StepMessage(0).encode()]  # nothing queued, nothing sent


def test_a_receiver_without_the_extension_stops_naming_the_request():
    ext0 = extension()
    channel = Recording()
    front0 = MultiProcessFront(FakeScheduler(ext0), channel)
    front0.submit([image_request(ext0)])
    assert front0.idle
    front1 = MultiProcessFront(FakeScheduler(), Receiving(channel.sent))  # type: ignore[arg-type]
    with pytest.raises(DivergenceError, match="request 'v' arrived with 2 images but this process's scheduler has no"):
        assert front1.idle
