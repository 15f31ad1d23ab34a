"""`KVTransferServer` in one process: an offer pulled through the transfer servers lands equal; a
pull from a transfer server that is gone fails at once, naming it, with no pull left waiting (a
pull thread left in the transfer library aborts the process when the interpreter exits)."""

from __future__ import annotations

import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from kvjax.disaggregation.kv_transfer import KVTransferServer, TransferUnreachable


@pytest.fixture(scope="module")
def servers() -> tuple[KVTransferServer, KVTransferServer]:
    return KVTransferServer(), KVTransferServer()


def _struct(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=SingleDeviceSharding(jax.local_devices()[0]))


def test_an_offer_is_pulled_equal(servers):
    offering, pulling = servers
    array = jnp.arange(24.0).reshape(2, 3, 4)
    offering.offer(7, [array])
    (pulled,) = pulling.pull(offering.address, 7, [_struct((2, 3, 4))], timeout_s=30.0)
    offering.drop(7)
    np.testing.assert_array_equal(np.asarray(pulled), np.asarray(array))
    assert offering.offers == 0 and pulling.bytes_pulled == array.nbytes


def test_a_pull_from_a_transfer_server_that_is_gone_fails_at_once(servers):
    _, pulling = servers
    with socket.socket() as sock:  # a port nothing listens on: a transfer server that exited
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(TransferUnreachable, match=f"the transfer server at {address} cannot be reached"):
        pulling.pull(address, 1, [_struct((4,))], timeout_s=30.0)
    assert time.monotonic() - started < 5.0
    assert not [t for t in threading.enumerate() if t.name.startswith("kv pull")], "a pull was left waiting"
