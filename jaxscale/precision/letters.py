"""The letters of a two-operand einsum equation: each operand's and the output's subscripts, and a projection's
batch, free and contracted letters (no jax)."""

from __future__ import annotations


def letters(equation: str) -> tuple[str, str, str]:
    """The operand and output subscripts of a two-operand einsum equation."""
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    return lhs, rhs, out


def split(equation: str) -> tuple[str, str, str, str]:
    """The letters of projection ``equation`` (``x``, ``w`` -> ``y``): batch (in both operands and the output: the
    experts'), free in ``x``, contracted, free in ``w``; a letter summed over in one operand only is refused."""
    lhs, rhs, out = letters(equation)
    shared = [c for c in lhs if c in rhs]
    if set(lhs + rhs) - set(out + "".join(shared)):
        raise ValueError(f"fp8 einsum {equation!r}: a letter summed over in one operand only")
    batch = "".join(c for c in shared if c in out)
    contract = "".join(c for c in shared if c not in out)
    return batch, "".join(c for c in lhs if c not in rhs), contract, "".join(c for c in rhs if c not in lhs)
