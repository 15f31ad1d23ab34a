"""The code of ``docs/integration.md`` runs as written (so the guide cannot rot): its ``python``
block is extracted and run in a fresh interpreter; a line ``expr  # N`` is also checked,
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


def test_the_guide_has_one_loop_and_it_runs():
    blocks = _python_blocks()
    assert len(blocks) == 1, "docs/integration.md has one python block (the user's own loop)"
    code = _with_checks(blocks[0])
    assert "assert (reused) == 32" in code
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "32"
