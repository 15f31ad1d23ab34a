"""Recurrent-state slot kernels (zero, fork) vs their reference; precondition race; in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import state_slots
from pallas_kernels.state_slots import (
    copy_state_slots,
    copy_state_slots_reference,
    zero_slots,
    zero_slots_reference,
)
from pallas_kernels.testing import TPU, assert_no_race, assert_same, interpreter_params, jit_interpreted, race_found
from tests.kernels.donation import run_donated

pytestmark = pytest.mark.timeout(60)
INTERPRETERS = interpreter_params()


def _states(seed: int = 0) -> tuple[jax.Array, ...]:
    """A conv-like and an SSM-like state of 3 layers and 6 slots (+ slot 0), different dtypes."""
    rng = np.random.default_rng(seed)
    conv = jnp.asarray(rng.standard_normal((3, 7, 2, 8)), jnp.float32)
    ssm = jnp.asarray(rng.integers(1, 60000, (3, 7, 2, 4, 8)), jnp.uint16)  # bf16 bits on CPU
    return conv, ssm


@pytest.mark.parametrize("interpret", INTERPRETERS)
def test_zero_slots_matches_reference(interpret, monkeypatch: pytest.MonkeyPatch) -> None:
    # A zero buffer of 2 layers: layer chunks 2 + 1, so the partial last chunk runs too.
    monkeypatch.setattr(state_slots, "ZERO_BUFFER_BYTES", 2 * 8 * 128 * 4)
    states = _states()
    slots = np.array([2, 5, 0, 9, -1, 3], np.int32)  # slot 0 and out of range are dropped
    want = zero_slots_reference(states, jnp.asarray(slots))
    got = jit_interpreted(zero_slots, interpret=interpret)(states, slots)
    assert_same(got, want)
    for a in got:
        assert not np.asarray(a[:, [2, 3, 5]]).any()
        assert np.asarray(a[:, [0, 1, 4, 6]]).all()
    assert_no_race()


@pytest.mark.parametrize("interpret", [None, *INTERPRETERS])
def test_fork_matches_reference_in_place(interpret) -> None:
    states = tuple(jnp.array(a) for a in _states())
    src, dst = np.array([1, 2, 3, 1], np.int32), np.array([4, 5, 6, 0], np.int32)  # a run of 3; dst 0 dropped
    want = copy_state_slots_reference(states, jnp.asarray(src), jnp.asarray(dst))
    got = run_donated(copy_state_slots, states, src, dst, interpret=interpret)
    assert_same(got, want)
    for a, b in zip(got, want, strict=False):
        np.testing.assert_array_equal(np.asarray(a[:, 4:7]), np.asarray(b[:, 1:4]))
    assert_no_race()


def test_fork_into_a_source_slot_breaks_the_precondition_and_is_reported() -> None:
    """A chain 1->2, 2->3 violates "no destination is a source": the detector must say so."""
    states = _states()
    jit_interpreted(copy_state_slots, interpret=TPU)(states, np.array([1, 4], np.int32), np.array([4, 5], np.int32))[
        0
    ].block_until_ready()
    assert race_found()


def test_bad_arguments_are_named() -> None:
    conv, ssm = _states()
    with pytest.raises(ValueError, match=r"states\[1\] has shape \[3, 6, 2, 4, 8\]; expected \[3, 7, \.\.\.\]"):
        zero_slots((conv, ssm[:, :6]), jnp.array([1]))
    with pytest.raises(ValueError, match=r"dst has shape \[2\]; expected \[1\]"):
        copy_state_slots((conv,), jnp.array([1]), jnp.array([2, 3]))
    with pytest.raises(TypeError, match="states must be a non-empty tuple"):
        zero_slots(conv, jnp.array([1]))
