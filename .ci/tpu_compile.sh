#!/usr/bin/env bash
# TPU compile tests: compile every Pallas kernel for v5e/v6e/v5p/v4 at real shapes, no TPU needed.
#
# Usage: .ci/tpu_compile.sh [REPO_ROOT]   (default: the parent of this script's directory)
#
# libtpu must not be installed next to the main test environment: with it importable, every JAX
# process takes a machine-wide lockfile and a second concurrent JAX process fails. So this
# script keeps its own virtual environment, REPO_ROOT/.venv-tpu (created on first use, reused
# after; it is git-ignored), installs the project with its test and tpu extras into it, and runs
# tests/tpu there, in two worker processes (ALLOW_MULTIPLE_LIBTPU_LOAD lets both load libtpu: they
# only compile, no TPU is opened). Exits non-zero if anything fails, including a missing
# libtpu: these tests must run, never skip.
set -euo pipefail

root="$(cd "${1:-"$(dirname "$0")/.."}" && pwd)"
venv="$root/.venv-tpu"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet -e "$root[test,tpu]"

cd "$root"
# addopts cleared: the project's default options ignore tests/tpu for the main run.
export ALLOW_MULTIPLE_LIBTPU_LOAD=1
exec "$venv/bin/python" -m pytest tests/tpu -q -p no:cacheprovider -o addopts="" -n 2 --dist loadfile
