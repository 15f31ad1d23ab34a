"""`MemoryStore`: the coordination service's key-value calls a channel makes, in memory (what the
channel tests run over, no ``jax.distributed``), and a cluster secret for tests."""

from __future__ import annotations

import threading

from kvjax.multihost.cluster_secret import ClusterSecret

__all__ = ["SECRET", "MemoryStore"]

#: One group's secret in the tests (a fresh one per test session).
SECRET = ClusterSecret.generate()


class MemoryStore:
    """The coordination service's key-value calls the channel makes, in memory: each key set
    once, blocking reads bounded by their timeout."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        with self.cond:
            assert key not in self.data, f"{key} set twice"
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout=timeout_in_ms / 1000):
                raise TimeoutError("DEADLINE_EXCEEDED")
            return self.data[key]

    def key_value_delete(self, key: str) -> None:
        with self.cond:
            for k in [k for k in self.data if k == key or k.startswith(key + "/")]:
                del self.data[k]
