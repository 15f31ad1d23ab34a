"""`FrameSealer` and `FrameOpener`: the HMAC-SHA256 tag every frame between two processes carries,
bound to its direction and its place in that direction's sequence.

A connection (or the key-value store's per-sender keys) has one key shared by both ends
(``derive_key``: derived from the group's ``ClusterSecret``, a purpose label and per-run or
per-connection nonces, so a key never serves two connections or two runs). Each direction
``sender -> receiver`` counts its frames from 0; frame ``i`` of that direction carries

    HMAC-SHA256(key, "kvjax frame" | sender u32 | receiver u32 | i u64 | frame bytes)

(``MAC_SIZE`` = 32 bytes, after the frame). The sequence number is not sent: each end counts for
itself, so a frame replayed, dropped, reordered or reflected back to its sender fails to verify,
as does one altered or sealed without the key. ``receiver`` is ``BROADCAST`` for a value every
process reads (the key-value store's).

Invariant: a sealer and the opener at the other end advance together, one per frame; an opener
advances only on a frame that verified (a failure ends the channel).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from kvjax.multihost.cluster_secret import ClusterSecret

__all__ = ["BROADCAST", "MAC_SIZE", "FrameOpener", "FrameSealer", "derive_key"]

#: Bytes of the tag after each frame (HMAC-SHA256).
MAC_SIZE = 32
#: The receiver of a frame every process reads.
BROADCAST = 0xFFFFFFFF

_LABEL = b"kvjax frame"
_PLACE = struct.Struct("<IIQ")


def derive_key(secret: ClusterSecret, purpose: bytes, *context: bytes) -> bytes:
    """A 32-byte key for ``purpose`` (a label naming its use) and ``context`` (nonces, names),
    each part length-prefixed so no two different contexts give the same input."""
    mac = hmac.new(secret.key, b"kvjax key", hashlib.sha256)
    for part in (purpose, *context):
        mac.update(struct.pack("<I", len(part)))
        mac.update(part)
    return mac.digest()


class _Direction:
    """One direction's keyed MAC state (the key and label absorbed once; each frame copies it)."""

    def __init__(self, key: bytes, sender: int, receiver: int) -> None:
        self._keyed = hmac.new(key, _LABEL, hashlib.sha256)
        self.sender = sender
        self.receiver = receiver
        self.sequence = 0

    def _tag(self, sequence: int, chunks: tuple[bytes | memoryview, ...]) -> bytes:
        mac = self._keyed.copy()
        mac.update(_PLACE.pack(self.sender, self.receiver, sequence))
        for chunk in chunks:
            mac.update(chunk)
        return mac.digest()


class FrameSealer(_Direction):
    """Seals the frames ``sender`` sends to ``receiver`` (module docstring). ``sequence``: frames
    sealed so far."""

    def seal(self, *chunks: bytes | memoryview) -> bytes:
        """The tag of the next frame (the concatenation of ``chunks``); advances the sequence."""
        tag = self._tag(self.sequence, chunks)
        self.sequence += 1
        return tag


class FrameOpener(_Direction):
    """Verifies the frames ``sender`` sends to ``receiver`` (module docstring). ``sequence``:
    frames verified so far (the next one expected)."""

    def verify(self, tag: bytes | memoryview, *chunks: bytes | memoryview) -> bool:
        """Whether ``tag`` seals the next frame (``chunks``); the sequence advances only on True."""
        if not hmac.compare_digest(self._tag(self.sequence, chunks), bytes(tag)):
            return False
        self.sequence += 1
        return True

    def verify_at(self, sequence: int, tag: bytes | memoryview, *chunks: bytes | memoryview) -> bool:
        """Whether ``tag`` seals frame ``sequence`` of this direction (for a store read by key,
        where the key's own place is the sequence); no state changes."""
        return hmac.compare_digest(self._tag(sequence, chunks), bytes(tag))
