"""The mesh tests: 8 CPU devices (``jax_num_cpu_devices``, set here before any jax backend starts).

Run them on their own (``.ci/run``'s mesh stage): ``python -m pytest -o addopts="" -m mesh tests/mesh``.
The default options ignore this folder, so the main suite keeps its one CPU device.
"""

from __future__ import annotations

import jax
import pytest

DEVICES = 8

jax.config.update("jax_num_cpu_devices", DEVICES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here carries the ``mesh`` marker."""
    for item in items:
        item.add_marker(pytest.mark.mesh)


@pytest.fixture(scope="session", autouse=True)
def eight_devices() -> None:
    """Fail clearly when the backend started before this folder could ask for 8 devices."""
    if len(jax.devices()) < DEVICES:
        pytest.fail(
            f"the mesh tests need {DEVICES} CPU devices and jax has {len(jax.devices())}: run tests/mesh in a "
            'process of its own (python -m pytest -o addopts="" -m mesh tests/mesh)'
        )
