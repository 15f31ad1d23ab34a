"""Fixtures of the kernel tests: a clean TPU-interpreter state around every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from jax.experimental.pallas import tpu as pltpu


@pytest.fixture(autouse=True)
def _fresh_tpu_interpreter() -> Iterator[None]:
    """A kernel that raised inside the TPU interpreter leaves its simulated memory behind;
    the next interpreted kernel would trip over it, so reset before and after each test."""
    pltpu.reset_tpu_interpret_mode_state()
    yield
    pltpu.reset_tpu_interpret_mode_state()
