"""The code of ``docs/integration.md`` runs as written (so the guide cannot rot): each ``python``
block is extracted and run in a fresh interpreter; a line ``print(expr)  # N`` is also checked,
``expr == N``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "integration.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def _with_checks(code: str) -> str:
    """``print(expr)  # N`` lines also assert ``expr == N``."""
    out = []
    for line in code.splitlines():
        m = re.fullmatch(r"print\((.+)\)\s+#\s*(-?\d+)", line.strip())
        out.append(line)
        if m:
            out.append(f"assert ({m.group(1)}) == {m.group(2)}, ({m.group(1)})")
    return "\n".join(out) + "\n"


def _run(code: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_the_guide_has_its_five_programs():
    blocks = _python_blocks()
    assert len(blocks) == 5, (
        "docs/integration.md: your own loop, your own model's spec, on a mesh, your own model in the scheduler, "
        "a cache kind"
    )
    assert "attend(pools, layer, q, k, v, meta)" in blocks[0] and "loop.admit(prompt)" in blocks[0]
    assert "ModelSpec.from_hf_config(" in blocks[1]
    assert "make_serving_mesh(2)" in blocks[2]
    assert "Scheduler(spec, cache, params, model=model" in blocks[3]
    assert "register_planner_kind(" in blocks[4] and "register_serving_kind(" in blocks[4]


def test_your_own_loop_runs():
    code = _with_checks(_python_blocks()[0])
    assert "assert (reused) == 32" in code
    assert _run(code).strip().splitlines()[-1] == "32"


def test_your_own_model_spec_runs():
    code = _with_checks(_python_blocks()[1])
    assert "assert (deeper.num_hidden_layers) == 4" in code
    assert _run(code).strip().splitlines()[-1] == "4"


def test_your_own_loop_on_a_mesh_runs():
    code = _with_checks(_python_blocks()[2])
    assert "assert (req.computed) == 19" in code
    assert _run(code).strip().splitlines()[-2:] == ["2", "19"]


def test_your_own_model_in_the_scheduler_runs():
    code = _with_checks(_python_blocks()[3])
    assert "assert (scheduler.stats.cached_tokens) == 64" in code
    assert _run(code).strip().splitlines()[-1] == "64"


def test_a_cache_kind_of_your_own_runs():
    code = _with_checks(_python_blocks()[4])
    assert "assert (int(cache.pools[NAME][0])) == 11" in code
    assert _run(code).strip().splitlines()[-1] == "11"
