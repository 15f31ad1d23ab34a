"""Suite-wide settings: a persistent XLA compilation cache shared by the test process and the
subprocesses it starts (``python -m kvjax ...``), so a step compiled once is not compiled again."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

# Transformers' references (torch) compute on one thread: the tensors of the tiny models are small,
# and on a machine whose cores the two test workers (and the processes the tests start) keep busy,
# torch's default of a thread per core waits at every operation's barrier for a core, which made a
# tiny model's greedy ``generate`` many times slower (1.4-3.8 s against 0.2 s for 24 tokens of the
# gpt-oss parity model on 2 busy cores). Set before torch (or numpy's BLAS) reads it; inherited by
# the processes the tests start. An explicit setting is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

_CACHE_DIR = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "kvjax-test-xla-cache")
)
# Every program is kept, however quick its compile: the tiny models' steps each compile in well under
# a second, and a process that loads them all from the cache (a CLI subprocess, a notebook's kernel,
# the next run) starts serving sooner than one that compiles them again.
_MIN_COMPILE_SECS = float(os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"))
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_SECS)


# The main suite's files that take longest (seconds of one worker in CI's suite stage, rounded),
# heaviest first. CI runs the suite with ``--no-loadscope-reorder``, so xdist hands files to its
# two workers in this order (``--dist loadfile``) instead of by their number of tests, which left
# heavy files of few tests (the real model, the pipeline benchmark) to the end, one worker serving
# them while the other had nothing left; the rest follow, those with more tests first (xdist's own
# order). tests/mesh orders its own stage (tests/mesh/conftest.py).
SUITE_HEAVIEST_FIRST = (
    "tests/test_readme.py",  # 140
    "tests/serve/test_real_model.py",  # 90
    "tests/serve/test_random_workloads.py",  # 70
    "tests/serve/test_speculative_swa.py",  # 40
    "tests/serve/test_eagle3.py",  # 45
    "tests/serve/test_matrix_pairs.py",  # 40
    "tests/serve/test_recurrent_retraction.py",  # 40
    "tests/serve/test_speculative_retraction.py",  # 30
    "tests/test_demo.py",  # 37
    "tests/serve/test_overlap.py",  # 34
    "tests/serve/test_parity_transformers.py",  # 22
    "tests/kernels/test_ragged_paged_attention.py",  # 20
    "tests/serve/test_swa_storage.py",  # 15
    "tests/serve/test_speculative_swa_host_tier.py",  # 14
    "tests/serve/test_speculative_cli.py",  # 13
    "tests/serve/test_recurrent_storage.py",  # 13
    "tests/serve/test_speculative_recurrent.py",  # 13
    "tests/kv_events/test_serving.py",  # 12
    "tests/test_pp_benchmark.py",  # 10
    "tests/radix/test_state_machine.py",  # 10
    "tests/serve/test_sessions.py",  # 9
    "tests/kernels/test_pk_page_copy.py",  # 9
    "tests/serve/test_speculative_eagle.py",  # 8
    "tests/serve/test_speculative_parity.py",  # 8
    "tests/gguf/test_gguf_checkpoint.py",  # 8
    "tests/serve/test_speculative.py",  # 7
    "tests/serve/test_eagle_host_tier.py",  # 7
    "tests/serve/test_parity_deepseek_v3.py",  # 7
)
_ROOT = Path(__file__).resolve().parent.parent
_MESH = _ROOT / "tests" / "mesh"


def _suite_rank(item: pytest.Item, tests_per_file: Counter[Path]) -> tuple[int, int]:
    name = item.path.relative_to(_ROOT).as_posix() if item.path.is_relative_to(_ROOT) else ""
    if name in SUITE_HEAVIEST_FIRST:
        return (SUITE_HEAVIEST_FIRST.index(name), 0)
    return (len(SUITE_HEAVIEST_FIRST), -tests_per_file[item.path])


#: A worker's resident memory (MiB) above which JAX's in-memory caches are dropped after a file.
RELEASE_ABOVE_MIB = 2048


def _resident_mib() -> int:
    """This process's resident memory in MiB (``VmRSS``; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


@pytest.fixture(scope="module", autouse=True)
def _release_programs_after_heavy_files() -> Iterator[None]:
    """After a test file, when the worker holds more than ``RELEASE_ABOVE_MIB``, JAX's in-memory
    caches are dropped. Every traced and compiled program is otherwise kept, per function object,
    for the worker's whole life: a serving file grew a worker by about 350 MB, and two such workers
    late in the suite left the host too little memory for the host tier's check (SGLang's 10 GiB
    reserve). Programs a later file needs again come from the persistent compilation cache
    (retracing a small file's programs after every file cost about 8%, so only above the bound)."""
    yield
    if _resident_mib() > RELEASE_ABOVE_MIB:
        jax.clear_caches()
        gc.collect()


def pytest_configure(config: pytest.Config) -> None:
    """torch imported before this file (by a plugin) read its thread count already: set it here."""
    torch = sys.modules.get("torch")
    if torch is not None and os.environ["OMP_NUM_THREADS"] == "1":
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The main suite's files in `SUITE_HEAVIEST_FIRST`'s order, then by their number of tests (a
    stable sort: each file's tests keep their order); a run with tests/mesh in it is left alone."""
    if any(item.path.is_relative_to(_MESH) for item in items):
        return
    tests_per_file = Counter(item.path for item in items)
    items.sort(key=lambda item: _suite_rank(item, tests_per_file))
