"""docs/paper.md names the code of each section of the paper as `file:symbol` and its tests as `file::test`: every
name must exist, so that the page cannot point at code that was renamed or moved."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "paper.md"
REFERENCE = re.compile(r"`((?:vaswani_hf|training|tests)/[\w/]+\.py)(::?)([\w.]+)`")


def defined_names(path: Path) -> set[str]:
    """Top-level functions, classes and assignments of a Python file, and `Class.member` for its classes' members."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{member.name}")
                    elif isinstance(member, (ast.Assign, ast.AnnAssign)):
                        targets = member.targets if isinstance(member, ast.Assign) else [member.target]
                        names.update(f"{node.name}.{t.id}" for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def references(text: str) -> list[tuple[str, str, str]]:
    return [match.groups() for match in REFERENCE.finditer(text)]


def missing_references(text: str) -> list[str]:
    """The page's references that name no file, no symbol of that file, or a test that is not a test function."""
    missing, cache = [], {}
    for file, separator, symbol in references(text):
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{file} (no such file)")
            continue
        names = cache.setdefault(file, defined_names(path))
        if symbol not in names:
            missing.append(f"{file}{separator}{symbol} (not defined there)")
        elif separator == "::" and not (file.startswith("tests/") and symbol.startswith("test_")):
            missing.append(f"{file}::{symbol} (not a test: write file:symbol for code)")
    return missing


def test_every_file_and_symbol_that_the_paper_page_names_exists():
    text = PAGE.read_text(encoding="utf-8")
    assert len(references(text)) >= 60, "docs/paper.md should name the code of every section it covers"
    assert missing_references(text) == []


def test_the_page_covers_the_papers_sections():
    text = PAGE.read_text(encoding="utf-8")
    for section in ("§3.1", "§3.2.1", "§3.2.2", "§3.2.3", "§3.3", "§3.4", "§3.5", "§5.1", "§5.3", "§5.4", "§6.1"):
        assert f"### {section}" in text or f"## {section}" in text, section


@pytest.mark.parametrize("reference, problem", [
    ("`vaswani_hf/modeling_vaswani.py:eager_attention_forwards`", "not defined there"),
    ("`vaswani_hf/modeling_vaswani.py:VaswaniAttention.not_a_method`", "not defined there"),
    ("`vaswani_hf/no_such_file.py:anything`", "no such file"),
    ("`tests/test_modeling.py::test_no_such_test`", "not defined there"),
    ("`vaswani_hf/modeling_vaswani.py::eager_attention_forward`", "not a test"),
])
def test_a_renamed_symbol_a_moved_file_or_a_missing_test_is_caught(reference, problem):
    (found,) = missing_references(reference)
    assert problem in found


def test_a_correct_reference_passes():
    assert missing_references("`vaswani_hf/modeling_vaswani.py:VaswaniAttention.forward` and "
                              "`tests/test_modeling.py::test_eager_attention_is_equation_1`") == []


def test_the_readme_points_at_the_page():
    assert "docs/paper.md" in (ROOT / "README.md").read_text(encoding="utf-8").split("\n## ")[0]


# docs/reliability.md: every point of its fault sections names the tests that hold it ----------------------------------

RELIABILITY = ROOT / "docs" / "reliability.md"
FAULT_SECTIONS = ("Loading safely", "Nothing lost, nothing silent", "Bad input", "Faults survived")
POINT = re.compile(r"^(?:- |\d+\. )", re.MULTILINE)


def section_points(text: str, heading: str) -> list[str]:
    """The bullets and numbered points of the `## heading` section of a page, each with its continuation lines."""
    sections = {part.split("\n", 1)[0].strip(): part for part in re.split(r"^## ", text, flags=re.MULTILINE)[1:]}
    body = sections.get(heading, "")
    starts = [match.start() for match in POINT.finditer(body)]
    return [body[start:end].strip() for start, end in zip(starts, [*starts[1:], len(body)], strict=False)]


def points_without_a_test(text: str) -> list[str]:
    """The points of `FAULT_SECTIONS` that name no `tests/...py::test_...` (their first words)."""
    return [f"{heading}: {point[:70]}" for heading in FAULT_SECTIONS for point in section_points(text, heading)
            if not any(file.startswith("tests/") and separator == "::" for file, separator, _ in references(point))]


def test_every_fault_claim_of_reliability_md_names_the_tests_that_hold_it():
    text = RELIABILITY.read_text(encoding="utf-8")
    counts = {heading: len(section_points(text, heading)) for heading in FAULT_SECTIONS}
    assert all(counts.values()), f"a section lost its heading or its points: {counts}"
    assert points_without_a_test(text) == []
    assert missing_references(text) == []


def test_every_test_a_docs_page_names_exists():
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert missing_references(page.read_text(encoding="utf-8")) == [], page.name


@pytest.mark.parametrize("point, caught", [
    ("- A refusal without a test.", True),
    ("- A refusal. Test: `tests/test_loading.py:test_no_code_of_ours_unpickles` (code, not a test).", True),
    ("- A refusal. Test: `vaswani_hf/checks.py::read_json`.", True),
    ("- A refusal. Test: `tests/test_loading.py::test_no_code_of_ours_unpickles`.", False),
])
def test_a_point_that_names_no_test_is_caught(point, caught):
    held = "- Refused. Test: `tests/test_loading.py::test_no_code_of_ours_unpickles`."
    page = f"## Bad input\n\nWhat is refused.\n\n{held}\n{point}\n\n## Faults survived\n\n1. {held[2:]}\n"
    assert points_without_a_test(page) == ([f"Bad input: {point[:70]}"] if caught else [])
