"""The maps hold: the README's repository table, ``docs/ARCHITECTURE.md``'s package map and floor table,
and the package docstring name every top-level part of ``sparse_io_attn`` (folder or module) and
nothing that is not there; the floor table's floors are ``tests/test_imports.py::FLOORS``; every file
the architecture names exists; every relative link of the docs (and its ``#anchor``) resolves.
Each failure names the entry to add, remove or fix, and the file to fix it in."""
from __future__ import annotations

import ast
import pathlib
import re
import sys
from collections.abc import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "sparse_io_attn"
README = REPO / "README.md"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
DOCS = [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md")),
        REPO / "examples" / "README.md", REPO / "benchmarks" / "results" / "README.md"]


def package_parts() -> set[str]:
    """Top-level folders and modules of the package that hold Python (what test_imports gives floors)."""
    return {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.rglob("*.py")} - {"__init__"}


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _section(path: pathlib.Path, heading: str) -> str:
    """The text under the ``## `` heading that starts with ``heading``, up to the next ``## ``."""
    text = _without_code_blocks(path.read_text())
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"{path.name} has no section '## {heading}...'"
    return match.group(1)


def _cells(row: str) -> list[str]:
    """A markdown table row split on the pipes outside backticks."""
    cells, cell, in_code = [], "", False
    for ch in row.strip().strip("|"):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    return cells + [cell.strip()]


def _table(section: str) -> list[list[str]]:
    """The rows of the first table in ``section``, header and rule left out."""
    lines = section.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def _code_names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _outside_parentheses(cell: str) -> str:
    out, depth = "", 0
    for ch in cell:
        depth += ch == "("
        if depth == 0:
            out += ch
        depth -= ch == ")" and depth > 0
    return out


def _part(name: str) -> str:
    return name.split("/")[0].removesuffix(".py")


def _compare(named: set[str], where: str) -> None:
    parts = package_parts()
    missing, extra = sorted(parts - named), sorted(named - parts)
    assert not missing and not extra, (
        f"{where} is out of step with the package: "
        + (f"add {missing} (parts of sparse_io_attn/ it does not name)" if missing else "")
        + ("; " if missing and extra else "")
        + (f"remove {extra} (named there, not in sparse_io_attn/)" if extra else ""))


# ----------------------------------------------------------------------------- README


def readme_repository_parts() -> set[str]:
    named = set()
    for row in _table(_section(README, "Repository")):
        names = _code_names(row[0])
        if names and names[0].startswith("sparse_io_attn/"):
            named |= {_part(n.removeprefix("sparse_io_attn/")) for n in names}
    return named


def test_readme_repository_table_names_every_package_part():
    _compare(readme_repository_parts(), "README.md's repository table ('## Repository')")


def test_readme_repository_table_paths_exist():
    missing = []
    for row in _table(_section(README, "Repository")):
        names = _code_names(row[0])
        prefix = "sparse_io_attn/" if names and names[0].startswith("sparse_io_attn/") else ""
        missing += [n for n in names if not (REPO / (prefix + n.removeprefix(prefix))).exists()]
    assert not missing, f"README.md's repository table names paths that do not exist: {missing}"


def test_readme_links_every_doc():
    row = next(r for r in _table(_section(README, "Repository")) if _code_names(r[0]) == ["docs/"])
    linked = {pathlib.Path(t).name for t in re.findall(r"\]\(docs/([^)#\s]+)", row[1])}
    docs = {p.name for p in (REPO / "docs").glob("*.md")}
    assert docs <= linked, f"README.md's repository table, row docs/: link {sorted(docs - linked)}"
    assert "](CHANGELOG.md)" in README.read_text(), "README.md links CHANGELOG.md"


# ----------------------------------------------------------------------------- ARCHITECTURE


def architecture_map_names() -> list[str]:
    return [_code_names(row[0])[0] for row in _table(_section(ARCHITECTURE, "Package map"))]


def test_architecture_package_map_names_every_package_part():
    _compare({_part(n) for n in architecture_map_names()}, "docs/ARCHITECTURE.md's package map")
    missing = [n for n in architecture_map_names() if not (PACKAGE / n).exists()]
    assert not missing, f"docs/ARCHITECTURE.md's package map names paths not in sparse_io_attn/: {missing}"


def architecture_floors() -> dict[str, int]:
    """``part -> floor`` from the floor table (the ``top`` row, the package's ``__init__``, left out)."""
    floors = {}
    for row in _table(_section(ARCHITECTURE, "Floors")):
        level = re.match(r"\d+", row[0])
        if level is None:
            assert row[0].startswith("top"), f"docs/ARCHITECTURE.md's floor table: floor {row[0]!r} is not a number"
            continue
        for name in _code_names(_outside_parentheses(row[1])):
            assert name not in floors, f"docs/ARCHITECTURE.md's floor table lists {name!r} twice"
            floors[name] = int(level.group())
    return floors


def import_floors() -> dict[str, int]:
    """``FLOORS`` of tests/test_imports.py, read with ``ast`` (the floors test's one table)."""
    tree = ast.parse((REPO / "tests" / "test_imports.py").read_text())
    for node in tree.body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(getattr(t, "id", None) == "FLOORS" for t in targets):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/test_imports.py has no FLOORS table")


def test_architecture_floor_table_is_the_floors_test():
    table, floors = architecture_floors(), import_floors()
    _compare(set(table), "docs/ARCHITECTURE.md's floor table ('## Floors')")
    differ = {n: (table.get(n), floors.get(n)) for n in set(table) | set(floors) if table.get(n) != floors.get(n)}
    assert not differ, ("docs/ARCHITECTURE.md's floor table and tests/test_imports.py::FLOORS differ "
                        f"(part: (doc floor, FLOORS floor)): {dict(sorted(differ.items()))}")


def test_architecture_names_only_files_that_exist():
    """Paths with a folder (``block_sparse/op.py``, ``_cpu/simd.h``, ``tests/...``) from the repository,
    the package, ``docs/`` or any part of the package (``triton/launch.py``)."""
    text = ARCHITECTURE.read_text()
    paths = set(re.findall(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.(?:py|h|cpp|md))(?!\w)", text))
    missing = sorted(p for p in paths
                     if not any(c.exists() for c in (REPO / p, PACKAGE / p, REPO / "docs" / p))
                     and not any(PACKAGE.glob(f"*/{p}")))
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"


# ----------------------------------------------------------------------------- the package docstring


def docstring_parts() -> set[str]:
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())) or ""
    return set(re.findall(r":mod:`\.(\w+)", doc))


def test_package_docstring_lists_every_part():
    _compare(docstring_parts(), "the module list of sparse_io_attn/__init__.py's docstring (:mod:`.name`)")


# ----------------------------------------------------------------------------- links


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> Iterator[str]:
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _without_code_blocks(path.read_text()), flags=re.M):
        slug = _slug(heading)
        yield slug if slug not in seen else f"{slug}-{seen[slug]}"
        seen[slug] = seen.get(slug, 0) + 1


def broken_links(path: pathlib.Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file) if file else path
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in set(anchors(dest)):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(REPO)})")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_doc_links_resolve(path):
    assert not broken_links(path), f"{path.relative_to(REPO)}: broken links: {broken_links(path)}"


# ----------------------------------------------------------------------------- the checks can fail


def test_the_checks_name_what_is_missing(monkeypatch):
    """A part the maps do not name, a part they name that is gone, a wrong floor and a dead anchor are
    each reported by name."""
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "package_parts", lambda: {"layout", "new_part"})
    with pytest.raises(AssertionError, match=r"add \['new_part'\].*remove \['old_part'\]"):
        _compare({"layout", "old_part"}, "a map")
    monkeypatch.undo()
    wrong = {**import_floors(), "layout": 3}
    monkeypatch.setattr(module, "import_floors", lambda: wrong)
    with pytest.raises(AssertionError, match=r"'layout': \(0, 3\)"):
        test_architecture_floor_table_is_the_floors_test()
    monkeypatch.undo()
    assert _slug("Checking the C++ kernel with sanitizers") == "checking-the-c-kernel-with-sanitizers"
    assert _slug("Per-token selections (`selection_attention`)") == "per-token-selections-selection_attention"
    assert _cells("| `a|b` | c |") == ["`a|b`", "c"]
    assert _code_names(_outside_parentheses("`x` (`y`, (`z`)), `w`")) == ["x", "w"]
