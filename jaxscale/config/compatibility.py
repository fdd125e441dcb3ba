"""``docs/compatibility.md``, generated from the refusal table and the silent selections (no jax).

``python -m jaxscale.config.compatibility > docs/compatibility.md`` writes it; ``tests/test_refusals.py``
regenerates it and compares. A feature is a config setting (a section's subsections, ``model.moe.*`` and
``model.deepseek.*``, count as one feature each); the matrix numbers each feature and puts in a cell the rules
(:data:`jaxscale.config.refusals.RULES`, by number) that name both.
"""

from __future__ import annotations

import itertools

from jaxscale.config import refusals, selections

GROUPED = ("model.moe", "model.deepseek")  # their subsections are one feature in the matrix

HEADER = """# Compatibility of features

Generated from `jaxscale/config/refusals.py` (every rule that names two or more config settings, each a row:
the settings, the predicate, the one line) and `jaxscale/config/selections.py` (where jaxscale picks among ways
to run without an error) by `python -m jaxscale.config.compatibility > docs/compatibility.md`;
`tests/test_refusals.py` checks that this file is what the tables give. A rule's line is the error
(`jaxscale: error: ...`) with its values left out (`…`). Rules marked *config* are checked when the config is
read, before jax starts, and again when the trainer is built; *layout* ones need the rules table on the mesh
(`rules`: the table's name, or what it maps: `layers` on `stage` runs a pipeline, `length` split is context
parallelism, `norm_length` split is sequence parallelism) and are checked when the trainer is built
(`Layout.validate`, also by `jaxscale inspect` and `plan --verify`); *model* ones read the model's parts too
(docs/models.md). `jaxscale inspect` prints the selections a run took (`selected: ...`).
"""


def feature(key: str) -> str:
    """The matrix's feature of a setting: ``model.moe.top_k`` is ``model.moe``."""
    return next((g for g in GROUPED if key == g or key.startswith(g + ".")), key)


def features() -> list[str]:
    """Every feature some rule names, in the table's order."""
    return list(dict.fromkeys(feature(k) for rule in refusals.RULES for k in rule.keys))


def pairs() -> dict[tuple[str, str], list[int]]:
    """(feature, feature) -> the numbers of the rules naming both (both orders)."""
    found: dict[tuple[str, str], list[int]] = {}
    for number, rule in enumerate(refusals.RULES, 1):
        named = dict.fromkeys(feature(k) for k in rule.keys)
        for a, b in itertools.permutations(named, 2):
            found.setdefault((a, b), []).append(number)
    return found


def matrix() -> list[str]:
    """The features x features grid: row i, column j holds the rules refusing feature i with feature j."""
    names, found = features(), pairs()
    lines = ["| feature | " + " | ".join(str(j) for j in range(1, len(names) + 1)) + " |",
             "|---|" + "---|" * len(names)]
    for i, a in enumerate(names, 1):
        cells = [",".join(map(str, found.get((a, b), []))) for b in names]
        lines.append(f"| {i} `{a}` | " + " | ".join(cells) + " |")
    return lines


def rules() -> list[str]:
    """The rules, numbered as the matrix names them: the settings, when checked, the line."""
    lines = ["| # | settings | checked | refused with the line |", "|---|---|---|---|"]
    for number, rule in enumerate(refusals.RULES, 1):
        keys = ", ".join(f"`{k}`" for k in rule.keys)
        lines.append(f"| {number} | {keys} | {rule.needs} | {rule.reason().replace('|', '/')} |")
    return lines


def selected() -> list[str]:
    """The silent selections: the settings each reads and what it picks."""
    lines = ["| selection | settings | what is picked, when |", "|---|---|---|"]
    for s in selections.SELECTIONS:
        lines.append(f"| {s.name} | {', '.join(f'`{k}`' for k in s.keys)} | {s.rule} |")
    return lines


def markdown() -> str:
    """The whole of docs/compatibility.md."""
    parts = [HEADER, "## The matrix", "",
             "A cell holds the numbers of the rules (below) that refuse the row's feature with the column's.", "",
             *matrix(), "", f"## The {len(refusals.RULES)} refusals", "", *rules(), "",
             "## Silent selections", "", *selected()]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
