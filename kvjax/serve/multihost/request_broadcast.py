"""`StepMessage`: what process 0 broadcasts before each step of multi-process serving (the
requests that entered since the last step, with the step they arrive at), and `RequestSpec`, the
wire form of a request.

Requests enter on process 0 (SGLang's and sglang-jax's multi-host schedulers receive on rank 0
and broadcast). Only what a fresh request is made of travels (id, prompt, generation limit, stop
ids, extra key (the tenant's cache salt), priority, retention), so every process builds an equal, unadmitted
``ServingReq`` and admits it at the same step, in the same order.

Both are typed, versioned messages (``kvjax.multihost.wire``): strict JSON whose decoding
refuses an unknown or missing field, a wrong type or another version, naming the field; nothing
is pickled. A request whose id or extra key is not one of the declared types is refused at
``submit`` on process 0 (``RequestSpec.of``), before anything travels.

Adding a request field (a session id, a retention time): declare it on `RequestSpec` with its
type and default, read it in ``of``, give it in ``build``, and raise ``REQUEST_VERSION``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from kvjax.multihost import wire
from kvjax.serve.serving_req import ServingReq

__all__ = ["REQUEST_VERSION", "STEP_VERSION", "RequestSpec", "StepMessage"]

#: The wire versions of the two messages (raise one when its fields change).
REQUEST_VERSION = 2
STEP_VERSION = 1

#: The wire form of a message with nothing but its step (the steady decode loop's): 8 bytes.
_STEP_ONLY = struct.Struct("<q")


@wire.wire_message("request", version=REQUEST_VERSION)
@dataclass(frozen=True)
class RequestSpec:
    """A fresh request, as it travels: enough to build an equal ``ServingReq`` anywhere.

    ``rid``: the request's id; ``prompt``: its token ids; ``max_new_tokens``: its generation
    limit (tokens); ``stop_token_ids``: sorted; ``extra_key``: the cache salt (SGLang's
    ``extra_key``: requests of different keys never share a cached page); ``priority``: its
    scheduling and eviction priority (higher is kept longer); ``retention_seconds``: how long its
    prefix is retained (``kvjax.radix.retention``; None: not), on the agreed retention clock.
    """

    rid: str | int
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    extra_key: str | int | None = None
    priority: int = 0
    retention_seconds: float | None = None

    @classmethod
    def of(cls, req: ServingReq) -> RequestSpec:
        """The spec of a request that has not been served yet.

        Raises:
            ValueError: the request was served already (its progress would not travel).
            WireError: a field cannot travel (an id or extra key of another type), named with
                its value.
        """
        if req.output_ids or req.req_pool_idx is not None:
            raise ValueError(f"request {req.rid!r} has been served already; submit fresh requests only")
        rid: Any = req.rid  # checked below, with the extra key, against the declared types
        extra_key: Any = req.extra_key
        spec = cls(
            rid,
            tuple(int(t) for t in req.origin_input_ids),
            req.max_new_tokens,
            tuple(sorted(req.stop_token_ids)),
            extra_key,
            int(getattr(req, "priority", 0) or 0),
            getattr(req, "retention_seconds", None),
        )
        try:
            wire.check(spec)
        except wire.WireError as e:
            raise wire.WireError(
                e.where, f"request {req.rid!r} cannot travel to the other processes: {str(e).partition(': ')[2]}"
            ) from None
        return spec

    def build(self) -> ServingReq:
        req = ServingReq(
            self.rid,
            list(self.prompt),
            max_new_tokens=self.max_new_tokens,
            extra_key=self.extra_key,
            stop_token_ids=self.stop_token_ids,
            priority=self.priority,
            retention_seconds=self.retention_seconds,
        )
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
