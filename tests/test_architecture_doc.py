"""docs/architecture.md against the code: its floors against the import graph, its tables against the modules.

The block under "The floors" lists each floor's wings (folders, ``name/``) and root modules (``name.py``);
every import of the package must go to the same floor or one below, every wing and root module must be
listed once, and every module of the package must have a row in the tables (and every row a module).
"""

from __future__ import annotations

import re

from test_import_graph import PACKAGE, import_graph

DOC = (PACKAGE.parent / "docs" / "architecture.md").read_text()
ROOT_MODULES_MAX = 12


def floors() -> dict[str, int]:
    """Each wing (``config/``) and root module (``cli.py``) -> its floor, from the doc's block."""
    block = DOC.split("## The floors", 1)[1].split("```", 2)[1]
    placed: dict[str, int] = {}
    for line in block.strip().splitlines():
        number, rest = line.split(maxsplit=1)
        for entry in re.findall(r"\S+(?:/|\.py)", rest):
            assert entry not in placed, f"{entry} is on two floors"
            placed[entry] = int(number)
    return placed


def entry(module: str) -> str:
    """``jaxscale.layout.rules`` -> ``layout/``; ``jaxscale.cli`` -> ``cli.py``; ``jaxscale`` -> ``__init__.py``."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    return f"{parts[0]}/" if (PACKAGE / parts[0]).is_dir() else f"{parts[0]}.py"


def test_every_wing_and_root_module_has_one_floor():
    wings = {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    roots = {p.name for p in PACKAGE.glob("*.py")}
    assert set(floors()) == wings | roots


def test_every_import_goes_to_its_own_floor_or_below():
    placed = floors()
    upward = [
        f"{a} (floor {placed[entry(a)]}) imports {b} (floor {placed[entry(b)]})"
        for a, targets in import_graph().items()
        for b in targets
        if placed[entry(b)] > placed[entry(a)]
    ]
    assert not upward, "\n".join(upward)


def test_the_root_holds_at_most_twelve_modules():
    assert len(list(PACKAGE.glob("*.py"))) <= ROOT_MODULES_MAX


def test_the_tables_name_every_module_and_only_modules():
    rows = re.findall(r"^\| ([^|]*`[^|]*) \|", DOC, re.M)
    named = {m for row in rows for m in re.findall(r"`([\w/]+\.py)`", row)}
    files = (p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent == PACKAGE)
    modules = {str(p.relative_to(PACKAGE)) for p in files}
    assert named - modules == set(), "rows for modules that do not exist"
    assert modules - named == set(), "modules without a row"


def test_the_moved_modules_table_names_modules_that_exist():
    moved = re.findall(r"^\| `jaxscale\.([\w.]+)` \| `jaxscale\.([\w.]+)` \|$", DOC, re.M)
    assert moved
    for old, new in moved:
        assert not (PACKAGE / f"{old.replace('.', '/')}.py").exists(), f"jaxscale.{old} is still there"
        path = PACKAGE / new.replace(".", "/")
        assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), f"jaxscale.{new} does not exist"
