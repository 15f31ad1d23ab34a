"""The combination matrix (issue 35): every pair of serving features per cache kind, constructed.

``tests/combinations.py`` constructs each cell as a user would (the command line's flag checks,
then the cache and its scheduler, nothing compiled or served) and holds the curated table. Here:
every cell's computed outcome (served, refused, dropped) must be the table's; every proving test
the table names must exist (its file defines that function); every refusal the table attributes
to SGLang names a file of SGLang's; and ``docs/combinations.md`` must be the table rendered
(``python -m tests.combinations --write`` regenerates it).
"""

from __future__ import annotations

import ast
import functools

import pytest

from tests import combinations
from tests.combinations import DOC, ROOT, cells, compute, computed_outcome, expected, render

pytestmark = pytest.mark.mesh


@functools.cache
def _results() -> dict[tuple[str, str, str], str]:
    return compute()


def test_every_cell_constructs_or_is_refused_as_the_table_says():
    wrong = []
    for cell, result in _results().items():
        want = expected(*cell)
        if computed_outcome(result) != want.outcome:
            wrong.append(f"{cell}: the table says {want.status}, the code gives {result}")
    assert not wrong, (
        "cells whose status and the code disagree (update REFUSED / PROOFS in tests/combinations.py, then "
        "python -m tests.combinations --write):\n" + "\n".join(wrong)
    )


def _defines(path: str, name: str) -> bool:
    tree = ast.parse((ROOT / path).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_every_proof_names_a_test_that_exists_and_every_table_key_is_a_cell():
    every = set(cells())
    assert set(combinations.PROOFS) <= every and set(combinations.REFUSED) <= every
    assert not set(combinations.PROOFS) & set(combinations.REFUSED)
    missing = []
    for key, proof in combinations.PROOFS.items():
        path, _, name = proof.partition("::")
        if not (ROOT / path).is_file() or not _defines(path, name):
            missing.append(f"{key}: {proof}")
    assert not missing, "proving tests that do not exist:\n" + "\n".join(missing)
    for cell in combinations.REFUSED.values():
        assert cell.reason is not None
        if cell.reason.startswith("sglang/"):
            assert cell.reason.split(" ", 1)[0].endswith(".py:") or " (" in cell.reason, cell.reason


def test_the_document_is_the_table_rendered():
    text = render(_results()) + "\n"
    assert DOC.read_text() == text, "docs/combinations.md is stale: run python -m tests.combinations --write"
