"""`ClusterSecret`: the key only the processes of one multi-process run hold, from which every
connection's and every frame's authentication is derived (``frame_auth``, ``handshake``).

Where it comes from, in order:

* given explicitly (``ProcessFlags(secret=...)``, ``SocketChannel.connect(secret=...)``,
  ``ProcessChannel(secret=...)``): a ``ClusterSecret``, its raw bytes, or its hex text;
* the environment variable ``KVJAX_CLUSTER_SECRET`` (``CLUSTER_SECRET_ENV``), hex text.
  ``python -m kvjax launch`` draws a fresh one per launch (``ClusterSecret.generate``, 32 bytes
  of ``secrets.token_bytes``) and hands it to the processes it starts through their environment
  only; on a TPU pod (``--distributed``) the operator exports the same value on every host, e.g.
  ``export KVJAX_CLUSTER_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')``.

Without one a process of several refuses to start (``MissingSecretError``, a
``CoordinatorError``): a group never runs unauthenticated, and no process invents a secret its
peers could not know. Only the launcher, which starts every process itself, generates one.

Invariants: the secret is never put on a command line, in a repr, a log line or an error message
(``repr`` shows ``<hidden>``; errors name the variable, never its value); it is at least
``MIN_SECRET_BYTES`` bytes.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping

from kvjax.multihost.errors import CoordinatorError

__all__ = ["CLUSTER_SECRET_ENV", "MIN_SECRET_BYTES", "ClusterSecret", "MissingSecretError", "SecretLike"]

#: The environment variable that carries the secret to each process, as hex text.
CLUSTER_SECRET_ENV = "KVJAX_CLUSTER_SECRET"
#: The shortest secret accepted (bytes; 128 bits).
MIN_SECRET_BYTES = 16
#: The length of a generated secret (bytes; 256 bits).
GENERATED_SECRET_BYTES = 32

_HOW = "e.g. python -c 'import secrets; print(secrets.token_hex(32))'"


class MissingSecretError(CoordinatorError):
    """A process of several found no cluster secret (or an unusable one): it cannot join."""


class ClusterSecret:
    """The group's shared key (module docstring). Compare with ``==`` (constant time)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes):
            raise TypeError(f"a cluster secret is bytes, got {type(key).__name__}")
        if len(key) < MIN_SECRET_BYTES:
            raise MissingSecretError(
                f"the cluster secret has {len(key)} bytes; give at least {MIN_SECRET_BYTES} random bytes ({_HOW})"
            )
        self._key = key

    @classmethod
    def generate(cls) -> ClusterSecret:
        """A fresh random secret (``GENERATED_SECRET_BYTES`` bytes from ``secrets``)."""
        return cls(secrets.token_bytes(GENERATED_SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str, *, source: str = "the cluster secret") -> ClusterSecret:
        """The secret written as hex text; ``MissingSecretError`` naming ``source`` (never the
        text) when it is not hex or too short."""
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            raise MissingSecretError(
                f"{source} is not hex text; give {2 * GENERATED_SECRET_BYTES} hex digits ({_HOW})"
            ) from None
        if len(key) < MIN_SECRET_BYTES:
            raise MissingSecretError(
                f"{source} has {len(key)} bytes; give at least {2 * MIN_SECRET_BYTES} hex digits ({_HOW})"
            )
        return cls(key)

    @classmethod
    def resolve(cls, given: SecretLike | None = None, environ: Mapping[str, str] | None = None) -> ClusterSecret:
        """The secret ``given`` explicitly, else the environment's ``CLUSTER_SECRET_ENV``.

        Raises:
            MissingSecretError: neither is set, or the one set is not a usable secret (the
                message says how to provide one; it never shows the value).
        """
        if isinstance(given, ClusterSecret):
            return given
        if isinstance(given, bytes):
            return cls(given)
        if isinstance(given, str):
            return cls.from_hex(given)
        if given is not None:
            raise TypeError(f"a cluster secret is a ClusterSecret, bytes or hex text, got {type(given).__name__}")
        env = os.environ if environ is None else environ
        text = env.get(CLUSTER_SECRET_ENV, "")
        if not text.strip():
            raise MissingSecretError(
                f"no cluster secret: a run of several processes authenticates every peer with one. "
                f"python -m kvjax launch sets {CLUSTER_SECRET_ENV} for the processes it starts; otherwise export the "
                f"same {CLUSTER_SECRET_ENV} (hex) to every process ({_HOW}), or pass secret= explicitly"
            )
        return cls.from_hex(text, source=CLUSTER_SECRET_ENV)

    @property
    def key(self) -> bytes:
        """The raw key (for deriving MAC keys only; never print it)."""
        return self._key

    def hex(self) -> str:
        """The secret as hex text: what ``CLUSTER_SECRET_ENV`` holds."""
        return self._key.hex()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(ClusterSecret)  # equal secrets hash alike; the hash reveals nothing of the key

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"


#: What callers may give as a secret.
SecretLike = ClusterSecret | bytes | str
