"""`StepMessage`: what process 0 broadcasts before each step of multi-process serving (the
requests that entered since the last step, with the step they arrive at), and the wire form of
a request.

Requests enter on process 0 (SGLang's and sglang-jax's multi-host schedulers receive on rank 0
and broadcast). Only what a fresh request is made of travels (id, prompt, generation limit, stop
ids, extra key), so every process builds an equal, unadmitted ``ServingReq`` and admits it at the
same step, in the same order.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

from kvjax.serve.serving_req import ServingReq

__all__ = ["RequestSpec", "StepMessage"]

#: The wire form of a message with nothing but its step (the steady decode loop's): 8 bytes.
_STEP_ONLY = struct.Struct("<q")


@dataclass(frozen=True)
class RequestSpec:
    """A fresh request, as it travels: enough to build an equal ``ServingReq`` anywhere."""

    rid: Any
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    extra_key: Any = None

    @classmethod
    def of(cls, req: ServingReq) -> RequestSpec:
        """The spec of a request that has not been served yet (ValueError otherwise: its
        progress would not travel)."""
        if req.output_ids or req.req_pool_idx is not None:
            raise ValueError(f"request {req.rid!r} has been served already; submit fresh requests only")
        return cls(
            req.rid,
            tuple(int(t) for t in req.origin_input_ids),
            req.max_new_tokens,
            tuple(sorted(req.stop_token_ids)),
            req.extra_key,
        )

    def build(self) -> ServingReq:
        return ServingReq(
            self.rid,
            list(self.prompt),
            max_new_tokens=self.max_new_tokens,
            extra_key=self.extra_key,
            stop_token_ids=self.stop_token_ids,
        )


@dataclass(frozen=True)
class StepMessage:
    """One process's message of one step's exchange. ``step``: the sender's step number (the
    exchange checks they match); ``requests``: process 0's new requests, arriving at ``step``
    (empty elsewhere); ``digest``: the sender's state digest after the previous step, when the
    agreement check is on (``kvjax.multihost.digest``).

    Wire form: a message with no request and no digest (every step of a steady decode loop) is
    its step as 8 bytes; any other is pickled (always longer than 8 bytes)."""

    step: int
    requests: tuple[RequestSpec, ...] = ()
    digest: dict[str, str] | None = field(default=None)

    def encode(self) -> bytes:
        if not self.requests and self.digest is None:
            return _STEP_ONLY.pack(self.step)
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def decode(raw: bytes) -> StepMessage:
        if len(raw) == _STEP_ONLY.size:
            return StepMessage(_STEP_ONLY.unpack(raw)[0])
        message = pickle.loads(raw)
        if not isinstance(message, StepMessage):
            raise TypeError(f"expected a StepMessage, got {type(message).__name__}")
        return message
