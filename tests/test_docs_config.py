"""The documentation site's references resolve, checked without building it (mkdocs not needed).

CI's docs step (``mkdocs build --strict``) fails on a ``::: name`` block whose module or object
does not exist; these tests catch the same mistake in the plain test suite. Every ``::: name`` in
``docs/api/*.md`` names an importable module or an attribute of one (a module is found without
being run, so no jax is imported), every API page is in ``mkdocs.yml``'s navigation, and every
page the navigation names exists. A function that the generator would leave out without a
warning (hidden by a submodule of the same name) must be named on its page through its module.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API_PAGES = sorted((DOCS / "api").glob("*.md"))
REFERENCE = re.compile(r"^:::\s+(\S+)", flags=re.MULTILINE)


def _page(path: Path) -> str:
    return path.relative_to(DOCS).as_posix()


def _references() -> list[tuple[str, str]]:
    return [(_page(p), name) for p in API_PAGES for name in REFERENCE.findall(p.read_text())]


def resolve(name: str) -> None:
    """Raises if ``name`` is neither a module nor an attribute path inside one.

    A module is only found (``find_spec``: its parent packages are imported, it is not run); an
    attribute path imports the longest module prefix and follows ``getattr``.
    """
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            continue
        if cut == len(parts):
            return
        obj: Any = importlib.import_module(module)
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError names the missing attribute
        return
    raise ModuleNotFoundError(f"no module named {parts[0]!r} (from the reference {name!r})")


def test_api_pages_have_references():
    assert API_PAGES, "docs/api/ holds no pages"
    assert {page for page, _ in _references()} == {_page(p) for p in API_PAGES}, "an API page without a ::: block"


@pytest.mark.parametrize(("page", "name"), _references(), ids=lambda v: str(v))
def test_reference_resolves(page, name):
    try:
        resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"docs/{page}: '::: {name}' does not resolve: {type(e).__name__}: {e}")


@pytest.mark.parametrize("name", ["kvjax.no_such_module", "kvjax.radix.NoSuchTree", "no_such_package.x"])
def test_a_broken_reference_is_caught(name):
    with pytest.raises((ImportError, AttributeError)):
        resolve(name)


def _package_dir(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    return path if (path / "__init__.py").is_file() else None


def _exported(package_dir: Path) -> list[str]:
    """The package's ``__all__``, read from its source (nothing is imported)."""
    for node in ast.parse((package_dir / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def _shadowed_names() -> list[tuple[str, str, str]]:
    """``(page, package, name)`` for each exported name that is also a submodule of the package."""
    found = []
    for page, name in _references():
        package_dir = _package_dir(name)
        if package_dir is None:
            continue
        for exported in _exported(package_dir):
            if (package_dir / f"{exported}.py").is_file() or (package_dir / exported / "__init__.py").is_file():
                found.append((page, name, exported))
    return found


@pytest.mark.parametrize(("page", "package", "name"), _shadowed_names(), ids=lambda v: str(v))
def test_a_name_shadowed_by_its_submodule_is_documented_through_it(page, package, name):
    """The generator (griffe) lets a submodule hide the package's export of the same name, so
    ``::: package`` leaves that function out without a warning; the page must name it through
    its module (``::: package.module.name``)."""
    names = [ref for ref_page, ref in _references() if ref_page == page]
    assert any(
        ref.startswith(f"{package}.") and ref.endswith(f".{name}") and ref != f"{package}.{name}" for ref in names
    ), (
        f"docs/{page}: {package}.{name} is hidden by the submodule of that name in the generated docs; "
        f"add '::: {package}.<its module>.{name}' to the page"
    )


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    if isinstance(nav, list):
        return [page for entry in nav for page in _nav_pages(entry)]
    return []


def _nav() -> list[Any]:
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):
        """mkdocs.yml's own tags (``!ENV``) read as null: only the navigation is wanted."""

    Loader.add_constructor("!ENV", lambda loader, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]


def test_every_api_page_is_in_the_navigation():
    missing = sorted({_page(p) for p in API_PAGES} - set(_nav_pages(_nav())))
    assert missing == [], f"pages under docs/api/ that mkdocs.yml's nav does not list: {missing}"


def test_every_navigation_page_exists():
    absent = [page for page in _nav_pages(_nav()) if not (DOCS / page).is_file()]
    assert absent == [], f"mkdocs.yml's nav names pages that are not under docs/: {absent}"
