"""README.md and docs/: the front page stays short, lists every command, and every path the documents
cite (a test, a module, a results file) or link to exists inside the repository."""

import argparse
import re
from pathlib import Path

import pytest

from megagrpo.cli import build_parser

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]

# A path in backquotes that starts at a top-level directory of the repository, up to a space, a colon
# (`shards.py: choose_path`) or the closing backquote.
CITED_PATH = re.compile(r"`((?:megagrpo|tests|benchmarks|configs|launch|tools|docs)/[^`\s:]*)")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _subcommands() -> list[str]:
    actions = build_parser()._actions
    sub = next(a for a in actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) < 150


def test_readme_cli_has_a_line_per_subcommand():
    text = README.read_text()
    for command in _subcommands():
        assert re.search(rf"^megagrpo {command}\b", text, re.MULTILINE), f"README.md: no line for {command}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_cited_paths_exist(doc):
    missing = [p for p in CITED_PATH.findall(doc.read_text()) if not (REPO / p.rstrip(".,;)")).exists()]
    assert not missing, f"{doc.relative_to(REPO)} cites paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_links_stay_inside_the_repository(doc):
    for link in MARKDOWN_LINK.findall(doc.read_text()):
        assert "://" not in link, f"{doc.relative_to(REPO)}: link outside the repository: {link}"
        target = (doc.parent / link.split("#")[0]).resolve()
        assert target.is_relative_to(REPO), f"{doc.relative_to(REPO)}: link outside the repository: {link}"
        assert target.exists(), f"{doc.relative_to(REPO)}: broken link {link}"


def _bad_input_rows() -> list[str]:
    text = (REPO / "docs" / "faults.md").read_text()
    section = text.split("\n## Bad input\n", 1)[1].split("\n## ", 1)[0]
    return [
        line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Bad input")
    ]


def test_every_bad_input_row_names_tests_that_exist():
    tests = (REPO / "tests" / "unit" / "test_bad_input.py").read_text()
    rows = _bad_input_rows()
    assert len(rows) >= 10
    for row in rows:
        named = re.findall(r"`(test_\w+)`", row.rsplit("|", 2)[1])
        assert named, f"docs/faults.md: a Bad input row names no test: {row[:80]}"
        for name in named:
            assert f"\ndef {name}(" in tests, (
                f"docs/faults.md names {name}, not in tests/unit/test_bad_input.py"
            )
