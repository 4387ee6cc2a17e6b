"""The README and docs/ point only at things a reader can open, and name only benchmarks
and commands that exist (docs/lmxd.md's protocol table is checked in test_conductor.py)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from swarmkv_ffi.cli import BENCHMARKS, build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def anchors(page: Path) -> set[str]:
    """The #fragments a Markdown page's headings answer to (GitHub's slugs)."""
    heads = re.findall(r"^#+\s+(.*?)\s*$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_opens(page):
    for target, fragment in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        path = page.parent / target if target else page
        assert path.exists(), f"{page.name} links to {target}, which does not exist"
        if fragment:
            assert fragment in anchors(path), f"{page.name} links to {target}#{fragment}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_benchmark_named_exists(page):
    named = set(re.findall(r"swarmkv bench ([a-z][a-z-]*)", page.read_text())) - {"NAME"}
    assert named <= set(BENCHMARKS), f"{page.name} names {sorted(named - set(BENCHMARKS))}"


def test_the_synopsis_lists_exactly_the_benchmarks():
    text = (ROOT / "README.md").read_text()
    first, rest = re.search(r"^swarmkv bench NAME \[its options\]\s+(.*)\n\s+(.*)$", text, re.M).groups()
    assert sorted((first + " " + rest).split()) == sorted(BENCHMARKS)


def test_readme_is_short_and_has_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024, len(text.encode())
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert blocks[0].startswith("./build_llama.sh && python3 -m venv .venv")
    assert blocks[1].strip() == ".venv/bin/python -m pytest -q"
    linked = {target for target, _ in LINK.findall(text)}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} | {"bench/README.md"}
    assert pages <= linked, sorted(pages - linked)   # the docs map: every page, once at least


def test_readme_synopsis_lists_every_subcommand():
    text = (ROOT / "README.md").read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    missing = [name for name in sub.choices if f"swarmkv {name}" not in text]
    assert not missing, missing


#: The packages whose __init__ is their map: each module, a line that says what it holds.
MAPPED = ["conductor", "kvcache", "admission", "lmxd", "serve", "fanout"]


def unmapped(package: Path) -> list[str]:
    """The modules of `package` its __init__'s docstring does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [p.name for p in sorted(package.glob("*.py"))
            if not p.name.startswith("__") and not re.search(rf"\b{re.escape(p.name)}\b", doc)]


def test_each_engine_package_maps_every_module_it_holds(tmp_path):
    missing = {name: unmapped(ROOT / "swarmkv_ffi" / name) for name in MAPPED}
    assert not any(missing.values()), f"name these in their package's __init__ docstring: {missing}"
    (tmp_path / "__init__.py").write_text('"""a.py does one thing."""\n')
    (tmp_path / "a.py").write_text("")
    (tmp_path / "b.py").write_text("")
    assert unmapped(tmp_path) == ["b.py"]          # the check sees a module left out


def defined_in(path: Path) -> set[str]:
    """What a module defines, as `name` and `Class.method`."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{m.name}" for m in node.body
                      if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            names |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                      if isinstance(t, ast.Name)}
    return names


def walk_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """(files, names) of each table row of docs/engine.md."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and "`" in cells[1]:
            rows.append((re.findall(r"`([^`]+)`", cells[1]), re.findall(r"`([^`]+)`", cells[2])))
    return rows


def test_the_engine_walk_names_only_what_exists():
    """docs/engine.md's walk and map stay true: each file exists under swarmkv_ffi/ and
    each name is defined in one of its row's files."""
    rows = walk_rows((ROOT / "docs" / "engine.md").read_text())
    assert len(rows) >= 20
    wrong = []
    for files, names in rows:
        paths = [ROOT / "swarmkv_ffi" / f for f in files]
        wrong += [f for f, p in zip(files, paths) if not p.exists()]
        known = set().union(*(defined_in(p) for p in paths if p.exists()))
        wrong += [f"{n} (in {', '.join(files)})" for n in names if n not in known]
    assert not wrong, f"docs/engine.md names what is not there: {wrong}"
    assert walk_rows("| x | `serve/nowhere.py` | `Gone.away` |") == [(["serve/nowhere.py"], ["Gone.away"])]
