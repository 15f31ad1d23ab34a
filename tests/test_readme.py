"""The README's code blocks run as written.

Every command of its ``bash`` blocks and every ``python`` block is collected (a ``\\``
continuation joined, ``&&`` chains split). Skipped, each with its reason in `SKIPPED`:

* ``pip install``: needs a download;
* ``python -m pytest``: the test suite itself;

A command's leading ``NAME=value`` words are its environment, as in a shell.
* ``mkdocs``: the documentation build, which CI's docs step runs (the ``docs`` extra);
* commands on ``./qwen2.5-0.5b``, ``./gemma-3-1b-it`` or ``path/to/config.json``: a downloaded
  checkpoint or the reader's own file, not in the repository.

Run in the default suite: the ``plan`` commands (jax-free, well under a second each) and the
Python blocks, where a line ``expr  # N`` (N a number) is also checked: ``expr == N``. The
benchmark commands are checked to resolve as written (the script's or module's imports run, as
``python benchmarks/x.py`` or ``python -m benchmarks.x`` would run them from the repository root,
with kvjax installed but the repository root not on the path); running them takes minutes each,
so their bodies are not run. Marked slow (``python -m pytest -m slow``): the ``demo`` commands,
each compiles the serving step for several batch shapes (about half a minute on 2 cores).

A command another test runs as written, with more checks, is not run here a second time
(`RUN_BY`): the DP attention ``launch`` across two processes, which the mesh stage runs (it needs
8 CPU devices for the single-process run it is compared with) with ``--json`` and compares with
one process's tokens, evictions and retractions. That test finds the command with
`readme_command`.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

SKIPPED = {
    "pip install": "needs a download (pip)",
    "python -m pytest": "the test suite itself",
    "./qwen2.5-0.5b": "needs a downloaded checkpoint directory",
    "./gemma-3-1b-it": "needs a downloaded checkpoint directory",
    "path/to/config.json": "a placeholder for the reader's own config.json",
    "mkdocs ": "the documentation build: CI's docs step runs it (needs the docs extra)",
}
SLOW = ("python -m kvjax demo", "python -m kvjax generate", "python -m kvjax launch")
#: README commands (by their start) that another test runs as written, with ``--json`` and more
#: checks: that test's file.
RUN_BY = {
    "python -m kvjax launch --processes 2 --cpu-devices-per-process 4 -- demo --tp 8 --dp 2": (
        "tests/mesh/test_multihost_dp.py"
    ),
}
BENCHMARK = re.compile(r"^python (benchmarks/\w+\.py|-m benchmarks\.\w+)\b")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def _commands() -> list[str]:
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            part: list[str] = []
            for word in [*shlex.split(line, comments=True), "&&"]:
                if word != "&&":
                    part.append(word)
                elif part:
                    commands.append(shlex.join(part))
                    part = []
    return commands


_ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def _split_env(command: str) -> tuple[dict[str, str], str]:
    """A command's leading ``NAME=value`` environment assignments, and the command after them."""
    words = shlex.split(command)
    env = {}
    while words and _ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, shlex.join(words)


def _skip_reason(command: str) -> str | None:
    return next((why for what, why in SKIPPED.items() if what in command), None)


def _env(tmp_path: Path) -> dict[str, str]:
    """kvjax importable as an installed package, without the repository root on the path (so a
    command that only works from inside the repository fails here as it would for a reader)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    for package in ("kvjax", "pallas_kernels"):
        link = site / package
        if not link.exists():
            link.symlink_to(ROOT / package)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(
    command: list[str], tmp_path: Path, timeout: int, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    out = subprocess.run(
        command,
        cwd=ROOT,
        env={**_env(tmp_path), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, f"{shlex.join(command)}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr
    return out


def _as_argv(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "python", command
    return [sys.executable, *words[1:]]


def _run_by(command: str) -> str | None:
    return next((test for start, test in RUN_BY.items() if command.startswith(start)), None)


COMMANDS = _commands()
KVJAX_COMMANDS = [
    c for c in COMMANDS if _split_env(c)[1].startswith("python -m kvjax") and not _skip_reason(c) and not _run_by(c)
]
BENCHMARK_COMMANDS = [c for c in COMMANDS if BENCHMARK.match(c)]


def readme_command(start: str) -> str:
    """The README's one command that starts with ``start`` (for a test that runs it as written)."""
    found = [c for c in COMMANDS if c.startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


def test_the_readme_blocks_are_all_classified():
    assert len(_blocks("python")) >= 3 and len(KVJAX_COMMANDS) >= 6 and len(BENCHMARK_COMMANDS) >= 10
    unclassified = [
        c for c in COMMANDS if not (_skip_reason(c) or _run_by(c) or c in KVJAX_COMMANDS or c in BENCHMARK_COMMANDS)
    ]
    assert unclassified == []


@pytest.mark.parametrize("start", RUN_BY)
def test_a_command_run_by_another_test_is_in_the_readme_and_that_test_runs_it(start):
    """Each `RUN_BY` command is one README command, and the test named runs it through
    `readme_command` (so it runs the README's words, not a copy)."""
    readme_command(start)
    source = (ROOT / RUN_BY[start]).read_text()
    assert "readme_command(" in source and f'"{start}"' in source, RUN_BY[start]


@pytest.mark.parametrize("command", [c for c in COMMANDS if _skip_reason(c)])
def test_commands_that_need_a_download_are_skipped(command):
    pytest.skip(f"{command}: {_skip_reason(command)}")


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=pytest.mark.slow) if _split_env(c)[1].startswith(SLOW) else c for c in KVJAX_COMMANDS],
)
def test_kvjax_command_runs_as_written(command, tmp_path):
    env, command = _split_env(command)
    out = _run(_as_argv(command), tmp_path, timeout=600, extra_env=env)
    assert out.stdout.strip(), f"{command} printed nothing"


_CHECKED_LINE = re.compile(r"^(?P<expr>[^#\s][^#]*?)\s+#\s*(?P<value>-?\d+)(?=[:,]|\s*$)")


def _with_checks(code: str) -> tuple[str, int]:
    """``expr  # N`` lines become ``assert (expr) == N``; returns the code and the checks made."""
    lines, checks = [], 0
    for line in code.splitlines():
        m = _CHECKED_LINE.match(line)
        if m is not None:
            try:
                ast.parse(m["expr"], mode="eval")
            except SyntaxError:
                pass
            else:
                line = f"assert ({m['expr']}) == {m['value']}, {line!r}"
                checks += 1
        lines.append(line)
    return "\n".join(lines) + "\n", checks


def test_readme_checks_are_found():
    code, checks = _with_checks("x = 1\nx + 1  # 2\nx  # 1: one\nf(x)  # -> 3\n")
    assert checks == 2 and "assert (x + 1) == 2" in code and "assert (x) == 1" in code


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs(index, tmp_path):
    code, _ = _with_checks(_blocks("python")[index])
    _run([sys.executable, "-c", code], tmp_path, timeout=300)


_RESOLVE = """\
import importlib, os, runpy, sys
root = os.getcwd()
rest = [p for p in sys.path[1:] if os.path.abspath(p or ".") != root]
for target in sys.argv[1:]:
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        del sys.modules[name]
    try:
        if target.endswith(".py"):  # python benchmarks/x.py: the script's folder comes first on the path
            sys.path[:] = [os.path.join(root, os.path.dirname(target)), *rest]
            runpy.run_path(target, run_name="readme_check")
        else:  # python -m benchmarks.x: the working directory comes first
            sys.path[:] = [root, *rest]
            importlib.import_module(target)
    except Exception as e:
        print(f"{target}: {type(e).__name__}: {e}")
"""


def test_benchmark_commands_resolve_as_written(tmp_path):
    """Each README benchmark command's script or module imports as that command would import it,
    all in one interpreter (its ``__main__`` block, the benchmark itself, is not run)."""
    targets = [BENCHMARK.match(c)[1].removeprefix("-m ") for c in BENCHMARK_COMMANDS]  # type: ignore[index]
    out = _run([sys.executable, "-c", _RESOLVE, *targets], tmp_path, timeout=300)
    assert out.stdout.strip() == "", f"README benchmark commands that do not run as written:\n{out.stdout}"
