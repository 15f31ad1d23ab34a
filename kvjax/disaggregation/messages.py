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
    "DecodeEvent",
    "DecodeEvents",
    "Hello",
    "LinkedPeers",
    "Offered",
    "PieceMessage",
    "PrefillEvent",
    "PrefillEvents",
    "PrefillOrder",
    "Prefilled",
    "PullOutcome",
    "PullOrder",
    "Refusal",
    "Release",
    "Welcome",
]


@wire_message("pd.hello", 2)
@dataclass(frozen=True)
class Hello:
    """Decode -> prefill, first: what the decode side serves. ``fingerprint``: the model's
    (``kvjax.serve.model_fingerprint``); ``signature``: each moved piece's name, per-token shape
    and dtype (``kv_transfer.cache_signature``); ``name``: the decode server's name (for
    messages); ``device_processes``: its ``SideLayout`` (the process of each of its pools'
    devices, ``piece_units``: how the pieces are cut follows from both sides' layouts)."""

    fingerprint: str
    signature: tuple[str, ...]
    name: str
    device_processes: tuple[int, ...]


@wire_message("pd.welcome", 2)
@dataclass(frozen=True)
class Welcome:
    """Prefill -> decode: the hello matched. ``transfer_addresses``: the transfer server of each
    of the prefill side's processes, by process id; ``page_size``: its page size (a fact);
    ``device_processes``: its ``SideLayout``."""

    name: str
    transfer_addresses: tuple[str, ...]
    page_size: int
    device_processes: tuple[int, ...]


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


@wire_message("pd.piece", 2)
@dataclass(frozen=True)
class PieceMessage:
    """One offered piece: ``pool``'s piece ``name`` of ``shape`` and ``dtype``, cut into
    ``units`` along ``head_axis`` (-1: one unit, whole; ``piece_units``)."""

    pool: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    head_axis: int
    units: int


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


# --- between the processes of one side (its group's channel; process 0 holds the links) ---------------


@wire_message("pd.prefill_event", 1)
@dataclass(frozen=True)
class PrefillEvent:
    """What process 0 of a prefill side read from its links, for every process to apply in
    order: ``kind`` ``"welcome"`` (link ``link`` matched: the decode side's ``device_processes``),
    ``"order"`` (room ``room``'s prompt ``input_ids`` in ``extra_key``), ``"pull"`` (tokens from
    ``start``, ``window``), ``"release"`` (room ``room``), ``"drop"`` (link ``link`` is gone),
    ``"stop"`` (the server stops)."""

    kind: str
    link: int = -1
    room: str = ""
    input_ids: tuple[int, ...] = ()
    extra_key: str | None = None
    start: int = 0
    window: int = 0
    device_processes: tuple[int, ...] = ()


@wire_message("pd.prefill_events", 1)
@dataclass(frozen=True)
class PrefillEvents:
    events: tuple[PrefillEvent, ...] = ()


@wire_message("pd.decode_event", 1)
@dataclass(frozen=True)
class DecodeEvent:
    """What process 0 of a decode side learned, for every process to apply in order: ``kind``
    ``"prefilled"`` (prefill server ``peer``'s ``Prefilled`` for room ``room``: ``first_token``,
    ``prompt_tokens``, ``error``), ``"fail"`` (room ``room`` failed: ``error``), ``"lost"``
    (prefill server ``peer`` is gone: ``error``)."""

    kind: str
    peer: int = -1
    room: str = ""
    first_token: int = -1
    prompt_tokens: int = 0
    error: str | None = None


@wire_message("pd.decode_events", 1)
@dataclass(frozen=True)
class DecodeEvents:
    events: tuple[DecodeEvent, ...] = ()


@wire_message("pd.peers", 1)
@dataclass(frozen=True)
class LinkedPeers:
    """Process 0 of a decode side to the others: the prefill servers it linked (``welcomes``, by
    ``addresses``), or why it could not (``error`` of type ``error_kind``: ``"refused"`` or
    ``"link"``)."""

    addresses: tuple[str, ...] = ()
    welcomes: tuple[Welcome, ...] = ()
    error: str = ""
    error_kind: str = ""


@wire_message("pd.pull_outcome", 1)
@dataclass(frozen=True)
class PullOutcome:
    """Process 0 of a decode side to the others: the prefill server's answer to a pull order
    (``offered``: none or one), or why there is none (``error``; ``lost``: its link failed)."""

    offered: tuple[Offered, ...] = ()
    error: str = ""
    lost: bool = False


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
