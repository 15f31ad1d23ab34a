"""`StepMessage`: what process 0 broadcasts before each step of multi-process serving (the
requests that entered since the last step, with the step they arrive at), and `RequestSpec`, the
wire form of a request.

Requests enter on process 0 (SGLang's and sglang-jax's multi-host schedulers receive on rank 0
and broadcast). Only what a fresh request is made of travels (id, prompt, generation limit, stop
ids, extra key (the tenant's cache salt), priority, retention, images), so every process builds an equal, unadmitted
``ServingReq`` and admits it at the same step, in the same order.

Images (a vision-language model): a request made by a ``MultimodalExtension`` travels with its
unpadded prompt (the placeholders) and its images as `WireImage` s (shape, dtype, the pixel
bytes in base64, and the item's content hash), and every other process makes it through its own
extension's ``request``: the same items, the same padded prompt, the same pixels kept, so every
process makes the same embedding-cache decisions. The preprocessing settings do not travel (they
are each process's extension's, the same configuration everywhere); the hash does, and a process
whose extension hashes an image differently (other settings) refuses the request naming both
hashes. Cost: about 4/3 of the pixel bytes per image, once, in the step the request arrives at.

Both are typed, versioned messages (``kvjax.multihost.wire``): strict JSON whose decoding
refuses an unknown or missing field, a wrong type or another version, naming the field; nothing
is pickled. A request whose id or extra key is not one of the declared types is refused at
``submit`` on process 0 (``RequestSpec.of``), before anything travels.

Adding a request field (a session id, a retention time): declare it on `RequestSpec` with its
type and default, read it in ``of``, give it in ``build``, and raise ``REQUEST_VERSION``.
(Version 3 added ``images``.)
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvjax.multihost import wire
from kvjax.multimodal.pad_values import is_pad_value
from kvjax.serve.serving_req import ServingReq

__all__ = [
    "IMAGE_DTYPES",
    "IMAGE_VERSION",
    "REQUEST_VERSION",
    "STEP_VERSION",
    "RequestSpec",
    "StepMessage",
    "WireImage",
]

#: The wire versions of the messages (raise one when its fields change).
REQUEST_VERSION = 3
STEP_VERSION = 1
IMAGE_VERSION = 1

#: The dtypes an image's pixels may travel as (numpy names; bytes little-endian on the wire).
IMAGE_DTYPES = (
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
)

#: The wire form of a message with nothing but its step (the steady decode loop's): 8 bytes.
_STEP_ONLY = struct.Struct("<q")


@wire.wire_message("image", version=IMAGE_VERSION)
@dataclass(frozen=True)
class WireImage:
    """One image's pixel values, as they travel.

    ``shape``: the array's shape (each dimension >= 1; the extension's images are ``[C, H, W]``);
    ``dtype``: one of :data:`IMAGE_DTYPES`; ``data``: the array's C-order, little-endian bytes,
    base64 (``prod(shape) * itemsize`` bytes decoded); ``item_hash``: the content hash process
    0's extension gave it (``hash_item``, in ``[0, 2**64)``), which the receiving process's
    extension must reproduce.

    Built (and decoded) only when consistent: an unknown dtype, a dimension below 1, data that is
    not base64 or not the size the shape and dtype need, or a hash out of range raises
    ValueError naming the field (on decoding, a ``WireError`` naming the image).
    """

    shape: tuple[int, ...]
    dtype: str
    data: str
    item_hash: int

    def __post_init__(self) -> None:
        if self.dtype not in IMAGE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: an image travels as one of {', '.join(IMAGE_DTYPES)}")
        if not self.shape or any(n < 1 for n in self.shape):
            raise ValueError(f"shape={self.shape!r}: give at least one dimension, each >= 1")
        if not 0 <= self.item_hash < 1 << 64:
            raise ValueError(f"item_hash={self.item_hash!r}: a content hash is an int in [0, 2**64)")
        try:
            raw = base64.b64decode(self.data.encode("ascii"), validate=True)
        except (UnicodeEncodeError, binascii.Error) as e:
            raise ValueError(f"data: not base64 ({e})") from None
        need = math.prod(self.shape) * np.dtype(self.dtype).itemsize
        if len(raw) != need:
            raise ValueError(f"data: {len(raw)} bytes, but shape {tuple(self.shape)} of {self.dtype} needs {need}")
        object.__setattr__(self, "_raw", raw)  # decoded once; not a field (never encoded, not compared)

    @classmethod
    def of(cls, pixels: np.ndarray, item_hash: int) -> WireImage:
        """The wire form of ``pixels`` (a numpy array of a dtype in :data:`IMAGE_DTYPES`, any byte
        order or layout; read, never changed) with its content hash.

        Raises:
            ValueError: another dtype, an empty dimension or a hash out of range (named).
        """
        array = np.asarray(pixels)
        name = array.dtype.name
        if name not in IMAGE_DTYPES:
            raise ValueError(f"pixels of dtype {array.dtype}: an image travels as one of {', '.join(IMAGE_DTYPES)}")
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        data = base64.b64encode(little.tobytes()).decode("ascii")
        return cls(tuple(int(n) for n in array.shape), name, data, int(item_hash))

    def array(self) -> np.ndarray:
        """The pixel values: a new, writable array of ``shape`` and ``dtype`` (native order)."""
        raw: bytes = vars(self)["_raw"]
        little = np.frombuffer(raw, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)
        return little.astype(np.dtype(self.dtype))


@wire.wire_message("request", version=REQUEST_VERSION)
@dataclass(frozen=True)
class RequestSpec:
    """A fresh request, as it travels: enough to build an equal ``ServingReq`` anywhere.

    ``rid``: the request's id; ``prompt``: its token ids (for a request with images, the
    unpadded prompt: its placeholders, which the receiving extension pads again);
    ``max_new_tokens``: its generation limit (tokens); ``stop_token_ids``: sorted; ``extra_key``:
    the cache salt (SGLang's ``extra_key``: requests of different keys never share a cached
    page); ``priority``: its scheduling and eviction priority (higher is kept longer);
    ``retention_seconds``: how long its prefix is retained (``kvjax.radix.retention``; None: not),
    on the agreed retention clock; ``images``: its images in prompt order (empty: a text request).
    """

    rid: str | int
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    extra_key: str | int | None = None
    priority: int = 0
    retention_seconds: float | None = None
    images: tuple[WireImage, ...] = ()

    @classmethod
    def of(cls, req: ServingReq, multimodal: Any = None) -> RequestSpec:
        """The spec of a request that has not been served yet. ``multimodal``: the scheduler's
        ``MultimodalExtension`` (or None); a request it made travels with its images.

        Raises:
            ValueError: the request was served already (its progress would not travel), or its
                prompt holds image pad values but ``multimodal`` holds no images of it (no
                extension, or another one made it).
            WireError: a field cannot travel (an id or extra key of another type), named with
                its value.
        """
        if req.output_ids or req.req_pool_idx is not None:
            raise ValueError(f"request {req.rid!r} has been served already; submit fresh requests only")
        held = multimodal.request_images(req) if multimodal is not None else None
        prompt: list[int] = [int(t) for t in req.origin_input_ids]
        images: tuple[WireImage, ...] = ()
        if held is not None:
            prompt, pixels = held
            hashes = [item.hash for item in multimodal.items(req)]
            images = tuple(WireImage.of(p, h) for p, h in zip(pixels, hashes, strict=True))
        elif any(is_pad_value(t) for t in prompt):
            where = (
                "the scheduler has no MultimodalExtension"
                if multimodal is None
                else "the scheduler's MultimodalExtension did not make it"
            )
            raise ValueError(
                f"request {req.rid!r} carries images (its prompt holds image pad values) but {where}, so its "
                "images cannot travel; give the scheduler the extension and make the request with its request(...)"
            )
        rid: Any = req.rid  # checked below, with the extra key, against the declared types
        extra_key: Any = req.extra_key
        spec = cls(
            rid,
            tuple(prompt),
            req.max_new_tokens,
            tuple(sorted(req.stop_token_ids)),
            extra_key,
            int(getattr(req, "priority", 0) or 0),
            getattr(req, "retention_seconds", None),
            images,
        )
        try:
            wire.check(spec)
        except wire.WireError as e:
            raise wire.WireError(
                e.where, f"request {req.rid!r} cannot travel to the other processes: {str(e).partition(': ')[2]}"
            ) from None
        return spec

    def build(self, multimodal: Any = None) -> ServingReq:
        """An equal, unadmitted ``ServingReq``; one with images is made by ``multimodal`` (this
        process's ``MultimodalExtension``: it registers the images, as on process 0).

        Raises:
            ValueError: images but no ``multimodal``, or an image whose hash here differs from
                process 0's (other preprocessing settings), naming the request and the image;
                nothing registered.
        """
        fields: dict[str, Any] = dict(
            max_new_tokens=self.max_new_tokens,
            extra_key=self.extra_key,
            stop_token_ids=self.stop_token_ids,
            priority=self.priority,
            retention_seconds=self.retention_seconds,
        )
        if not self.images:
            return ServingReq(self.rid, list(self.prompt), **fields)
        if multimodal is None:
            raise ValueError(
                f"request {self.rid!r} arrived with {len(self.images)} images but this process's scheduler has no "
                "MultimodalExtension: every process must serve the same model with the same extensions"
            )
        pixels = [image.array() for image in self.images]
        for i, (image, mine) in enumerate(zip(self.images, multimodal.image_hashes(pixels), strict=True)):
            if mine != image.item_hash:
                raise ValueError(
                    f"request {self.rid!r} image {i}: process 0 hashed it {image.item_hash:#x}, this process "
                    f"{mine:#x}: the processes' preprocessing settings (or image dtypes) differ"
                )
        req: ServingReq = multimodal.request(self.rid, list(self.prompt), pixels, **fields)
        return req


@wire.wire_message("step", version=STEP_VERSION)
@dataclass(frozen=True)
class StepMessage:
    """One process's message of one step's exchange. ``step``: the sender's step number (the
    exchange checks they match); ``requests``: process 0's new requests, arriving at ``step``
    (empty elsewhere); ``digest``: the sender's state digest after the previous step, when the
    agreement check is on (``kvjax.multihost.digest``).

    Wire form: a message with no request and no digest (every step of a steady decode loop) is
    its step as 8 bytes; any other is its ``wire`` encoding (JSON, always longer than 8 bytes)."""

    step: int
    requests: tuple[RequestSpec, ...] = ()
    digest: dict[str, str] | None = None

    def encode(self) -> bytes:
        if not self.requests and self.digest is None:
            return _STEP_ONLY.pack(self.step)
        return wire.encode(self)

    @staticmethod
    def decode(raw: bytes) -> StepMessage:
        """The message ``raw`` encodes; ``WireError`` naming the field when it is not a valid
        step message of this version."""
        if len(raw) == _STEP_ONLY.size:
            return StepMessage(_STEP_ONLY.unpack(raw)[0])
        return wire.decode(raw, StepMessage)
