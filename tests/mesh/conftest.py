"""The mesh tests: 8 CPU devices (``jax_num_cpu_devices``, set here before any jax backend starts).

Run them on their own (``.ci/run``'s mesh stage): ``python -m pytest -o addopts="" -m mesh tests/mesh``.
The default options ignore this folder, so the main suite keeps its one CPU device.

Order: the stage runs two workers, one file each at a time (``-n 2 --dist loadfile
--no-loadscope-reorder``), so the files that take longest start first (``HEAVIEST_FIRST``, by
their measured time, heaviest first) and the two workers end together; the other files follow,
those with more tests first (xdist's own order).
"""

from __future__ import annotations

from collections import Counter

import jax
import pytest

from tests.mesh.tp_serving import family_checkpoint

DEVICES = 8

# The files that take longest (seconds on a 2-core machine running both workers, rounded), heaviest
# first: the disaggregated pairs spawn two processes per test, the multi-process files a group of
# processes each, the real model loads it twice (kvjax, Transformers). Every file of 10 s or more
# is listed: a file left to xdist's order by test count runs near the end, and a heavy one there
# leaves the other worker idle.
HEAVIEST_FIRST = (
    "test_pd_families.py",  # 100
    "test_pd_faults.py",  # 80
    "test_matrix_pairs.py",  # 100
    "test_dcp_recurrent.py",  # 80 (35 with the persistent compilation cache warm)
    "test_multihost_speculative.py",  # 100 (four launches of two processes)
    "test_dcp_swa.py",  # 60
    "test_pp_eagle.py",  # 55
    "test_dp_speculative.py",  # 55
    "test_dcp_speculative.py",  # 45
    "test_multihost_dcp.py",  # 45
    "test_dp_dcp_host_tier.py",  # 25
    "test_tp_speculative_overlap.py",  # 24
    "test_multihost_storage.py",  # 35
    "test_deepseek_v3_composition.py",  # 35
    "test_pp_tiers.py",  # 30
    "test_dp_pp.py",  # 30
    "test_multihost_dp.py",  # 33
    "test_real_model_tp.py",  # 32
    "test_pd_speculative.py",  # 29
    "test_multihost_generate.py",  # 27
    "test_multihost_parity.py",  # 26
    "test_multihost_dp_speculative_recurrent.py",  # 26
    "test_pd_llama.py",  # 25
    "test_dp_parity.py",  # 25
    "test_dp_speculative_recurrent.py",  # 25
    "test_tp_speculative.py",  # 24
    "test_dp_dcp.py",  # 24
    "test_pd_processes.py",  # 22
    "test_multihost_host_tier.py",  # 22
    "test_tp_parity_qwen3_next_tp4.py",  # 20
    "test_tp_eagle.py",  # 20
    "test_recurrent_storage_tp.py",  # 20
    "test_recurrent_retraction_tp.py",  # 20
    "test_tp_parity_qwen3_next.py",  # 18
    "test_pd_cli.py",  # 18
    "test_multihost_dp_recurrent.py",  # 18
    "test_dp_overlap.py",  # 18
    "test_tp_parity_nemotron_h.py",  # 17
    "test_combination_matrix.py",  # 17
    "test_dp_hybrid_host_tier.py",  # 16
    "test_swa_storage_tp.py",  # 15
    "test_multihost_serving.py",  # 14
    "test_multihost_llava.py",  # 13
    "test_tp_parity.py",  # 13
    "test_multihost_agreement.py",  # 11
    "test_tp_speculative_swa.py",  # 14 (the attention kernels traced once per shape)
    "test_pp_recurrent.py",  # 10 (the state forks one compiled program)
)

jax.config.update("jax_num_cpu_devices", DEVICES)


def _file_rank(item: pytest.Item, tests_per_file: Counter[str]) -> tuple[int, int]:
    """Heaviest listed files first, in ``HEAVIEST_FIRST``'s order; then files with more tests."""
    name = item.path.name
    if name in HEAVIEST_FIRST:
        return (HEAVIEST_FIRST.index(name), 0)
    return (len(HEAVIEST_FIRST), -tests_per_file[name])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here carries the ``mesh`` marker; files in the order of the module docstring
    (a stable sort: each file's tests keep their order)."""
    for item in items:
        item.add_marker(pytest.mark.mesh)
    tests_per_file = Counter(item.path.name for item in items)
    items.sort(key=lambda item: _file_rank(item, tests_per_file))


@pytest.fixture(scope="session", autouse=True)
def eight_devices() -> None:
    """Fail clearly when the backend started before this folder could ask for 8 devices."""
    if len(jax.devices()) < DEVICES:
        pytest.fail(
            f"the mesh tests need {DEVICES} CPU devices and jax has {len(jax.devices())}: run tests/mesh in a "
            'process of its own (python -m pytest -o addopts="" -m mesh tests/mesh)'
        )


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    """``(hf, model)`` of the tiny parity Llama (``tp_serving.family_checkpoint("llama")``), built
    once per test module that asks for it (a module's own ``llama`` fixture takes its place)."""
    return family_checkpoint("llama", tmp_path_factory)
