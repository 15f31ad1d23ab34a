"""The messages between a decode server and a prefill server, as typed wire messages.

Order on one link (decode -> prefill is ``D>``, prefill -> decode ``P>``)::

    D> Hello            the decode side's cache signature; P> Welcome (or Refusal, then close)
    D> PrefillOrder     compute this prompt (room = the request's id on the link)
    P> Prefilled        done: its first token and prompt length (or ``error``)
    D> PullOrder        offer tokens [start, prompt) of room
    P> Offered          the pieces' specs under a fresh transfer id (or ``error``)
    D> Release          the room is done with (pulled, or given up): P drops its snapshot

Every frame is one kind byte (``KINDS``) and one message; the receiver decodes the message with the
class its kind names (a closed table: nothing from the wire picks a class) and refuses any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvjax.multihost.wire import wire_message

__all__ = [
    "KINDS",
    "Hello",
    "Offered",
    "PieceMessage",
    "PrefillOrder",
    "Prefilled",
    "PullOrder",
    "Refusal",
    "Release",
    "Welcome",
]


@wire_message("pd.hello", 1)
@dataclass(frozen=True)
class Hello:
    """Decode -> prefill, first: what the decode side serves. ``fingerprint``: the model's
    (``kvjax.serve.model_fingerprint``); ``signature``: each moved piece's name, per-token shape
    and dtype (``kv_transfer.cache_signature``); ``head_shards``: devices its KV heads are split
    over; ``name``: the decode server's name (for messages)."""

    fingerprint: str
    signature: tuple[str, ...]
    head_shards: int
    name: str


@wire_message("pd.welcome", 1)
@dataclass(frozen=True)
class Welcome:
    """Prefill -> decode: the hello matched. ``transfer_address``: the prefill's transfer server;
    ``head_shards``: devices its KV heads are split over; ``page_size``: its page size (facts)."""

    name: str
    transfer_address: str
    head_shards: int
    page_size: int


@wire_message("pd.refusal", 1)
@dataclass(frozen=True)
class Refusal:
    """Prefill -> decode: the hello did not match (``reason`` names what); the link closes."""

    reason: str


@wire_message("pd.prefill", 1)
@dataclass(frozen=True)
class PrefillOrder:
    """Compute room ``room``'s prompt ``input_ids`` in namespace ``extra_key`` (the tenant's
    cache salt)."""

    room: str
    input_ids: tuple[int, ...]
    extra_key: str | None = None


@wire_message("pd.prefilled", 1)
@dataclass(frozen=True)
class Prefilled:
    """Room ``room``'s prompt is computed: ``first_token`` (greedy) and ``prompt_tokens``; or
    ``error`` (nothing kept)."""

    room: str
    first_token: int = -1
    prompt_tokens: int = 0
    error: str | None = None


@wire_message("pd.pull", 1)
@dataclass(frozen=True)
class PullOrder:
    """Offer room ``room``'s tokens ``[start, prompt)``; ``window``: the sliding-window tokens
    the decode side needs before the prompt's end (0: none)."""

    room: str
    start: int
    window: int = 0


@wire_message("pd.piece", 1)
@dataclass(frozen=True)
class PieceMessage:
    """One offered array: ``pool``'s piece ``name`` of ``shape`` and ``dtype``, split over
    ``shards`` devices along ``head_axis`` (-1: whole, on one device)."""

    pool: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    head_axis: int
    shards: int


@wire_message("pd.offered", 1)
@dataclass(frozen=True)
class Offered:
    """Room ``room``'s tokens ``[start, end)`` are offered under ``transfer_id`` (the prefill
    server's, fresh per offer) as ``pieces`` (the sliding-window pieces from token
    ``window_start``); or ``error`` (nothing offered)."""

    room: str
    transfer_id: int
    start: int = 0
    end: int = 0
    window_start: int = 0
    pieces: tuple[PieceMessage, ...] = ()
    error: str | None = None


@wire_message("pd.release", 1)
@dataclass(frozen=True)
class Release:
    """The decode side is done with room ``room`` (pulled, or gave up)."""

    room: str


#: Frame kind byte -> message class (the closed table a frame is decoded through).
KINDS: dict[int, type] = {
    1: Hello,
    2: Welcome,
    3: Refusal,
    4: PrefillOrder,
    5: Prefilled,
    6: PullOrder,
    7: Offered,
    8: Release,
}
