"""Fixtures of the kernel tests: a clean TPU-interpreter state around every test."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu


@pytest.fixture(autouse=True)
def _fresh_tpu_interpreter() -> Iterator[None]:
    """A kernel that raised inside the TPU interpreter leaves its simulated memory behind;
    the next interpreted kernel would trip over it, so reset before and after each test."""
    pltpu.reset_tpu_interpret_mode_state()
    # The race detector's vector clocks are approximate: each DMA gets a random virtual core id
    # from numpy's global generator, and two DMAs that draw the same id look ordered, so a race
    # between them is missed (about 1 time in 63 per pair). Seeding makes every test see the
    # same draws, run after run, in any order.
    np.random.seed(0)
    yield
    pltpu.reset_tpu_interpret_mode_state()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The TPU interpreter (race detection, every DMA simulated) is the slow one: the cases of a
    parametrized matrix that run under it form the ``slow`` stage, which ``.ci/run`` runs after
    the main suite (``python -m pytest -m slow``). Single tests that use it on purpose (the
    provoked race and out-of-bounds checks) stay in the main suite."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(isinstance(v, pltpu.InterpretParams) for v in callspec.params.values()):
            item.add_marker(pytest.mark.slow)
