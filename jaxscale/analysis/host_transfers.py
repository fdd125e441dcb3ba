"""The host transfers of a compiled program: moves between device memory and host memory (``S(5)``).

An offloaded activation (:mod:`jaxscale.layout.offload`) is written into a host buffer by the forward and read back
by the backward; XLA:GPU schedules each move as an asynchronous pair, a ``*-start`` whose operands or result
lie in memory space 5 and its ``*-done`` (``dynamic-update-slice-start``/``dynamic-slice-start`` fusions,
``copy-start``). :func:`read` counts them per program, as overlapped where compute (a fusion, a library call,
a dot or convolution) is scheduled between the two, else idle. XLA:CPU's programs hold none (one memory).
"""

from __future__ import annotations

import re

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"[\]})] ([a-z][\w-]*)\(")
_COMPUTE = {"fusion", "custom-call", "dot", "convolution"}


def _instructions(hlo: str) -> list[list[tuple[str, str, str]]]:
    """Each computation's instructions in scheduled order, as (name, opcode, text)."""
    computations: list[list[tuple[str, str, str]]] = [[]]
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            computations.append([])
            continue
        found = _INSTRUCTION.match(line)
        opcode = _OPCODE.search(found.group(2)) if found else None
        if found and opcode:
            computations[-1].append((found.group(1), opcode.group(1), found.group(2)))
    return computations


def read(hlo: str) -> dict[str, int]:
    """``async``: the host transfers started asynchronously; ``overlapped``: those with compute between start
    and done."""
    counts = {"async": 0, "overlapped": 0}
    for body in _instructions(hlo):
        for i, (name, opcode, text) in enumerate(body):
            if not opcode.endswith("-start") or ":S(5)" not in text:
                continue
            done = next((j for j in range(i + 1, len(body))
                         if body[j][1].endswith("-done") and f"%{name})" in body[j][2]), None)
            if done is None:
                continue
            counts["async"] += 1
            counts["overlapped"] += any(op in _COMPUTE for _, op, _ in body[i + 1:done])
    return counts
