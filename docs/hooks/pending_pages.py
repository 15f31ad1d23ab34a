"""MkDocs hook: a page whose subject is not in this tree yet is left out of the build.

`PENDING` maps a page (relative to ``docs/``) to the file, relative to the repository root, that
the page documents or is. While that file is absent, the page is dropped from the site's files
and navigation, with an INFO line saying so; once the file is present, the page is built like
any other, and strict mode fails the build on any reference in it that does not resolve. An
entry whose file is present changes nothing and can be deleted.

``tests/test_docs_config.py`` reads `pending_pages` too, so the reference check skips exactly
the pages the build leaves out.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

PENDING: dict[str, str] = {
    "api/attention.md": "kvjax/attention/__init__.py",
    "integration.md": "docs/integration.md",
}

log = logging.getLogger("mkdocs.hooks.pending_pages")


def pending_pages(root: Path = ROOT) -> dict[str, str]:
    """The entries of `PENDING` whose file is absent under ``root``: page -> that file."""
    return {page: subject for page, subject in PENDING.items() if not (root / subject).exists()}


def nav_without(nav: list[Any], pages: set[str]) -> list[Any]:
    """``nav`` (MkDocs' list of pages, ``{title: page}`` and ``{section: [...]}``) without ``pages``;
    a section left empty goes too."""
    kept: list[Any] = []
    for entry in nav:
        if isinstance(entry, dict):
            entry = {
                title: nav_without(value, pages) if isinstance(value, list) else value for title, value in entry.items()
            }
            entry = {title: value for title, value in entry.items() if value != [] and not _is_page_in(value, pages)}
            if entry:
                kept.append(entry)
        elif not _is_page_in(entry, pages):
            kept.append(entry)
    return kept


def _is_page_in(value: Any, pages: set[str]) -> bool:
    return isinstance(value, str) and value in pages


def on_config(config: Any) -> Any:
    missing = pending_pages(Path(config.config_file_path).parent)
    for page, subject in missing.items():
        log.info("%s is left out of the site: %s is not in this tree", page, subject)
    if missing and config.nav is not None:
        config.nav = nav_without(config.nav, set(missing))
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import InclusionLevel

    for page in pending_pages(Path(config.config_file_path).parent):
        found = files.get_file_from_path(page)
        if found is not None:
            found.inclusion = InclusionLevel.EXCLUDED  # as `exclude_docs` would: not built, links to it are INFO
    return files
