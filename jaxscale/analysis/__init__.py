"""The analysis wing: what a train step holds and moves, predicted and as compiled.

Predicted, without compiling (the analytic model; none of these imports jax):

* :mod:`~jaxscale.analysis.params`: its inputs: parameters with their logical axes, their
  placement by a rules table on the mesh sizes, the batch side of the step;
* :mod:`~jaxscale.analysis.memory`, :mod:`~jaxscale.analysis.communication`,
  :mod:`~jaxscale.analysis.timing`: bytes per device, collectives, seconds per step;
* :mod:`~jaxscale.analysis.predict`: the three on one layout (or on a built trainer);
* :mod:`~jaxscale.analysis.formulas`: FORMULAS.md's closed forms on the same inputs;
* :mod:`~jaxscale.analysis.plan`: ``jaxscale plan``, the search over layouts.

As compiled: :mod:`~jaxscale.analysis.xla` (the step compiled from abstract values, its memory),
:mod:`~jaxscale.analysis.hlo` (its collectives, parsed from the HLO text); the two side by side:
:mod:`~jaxscale.analysis.inspect` (``jaxscale inspect``) and :mod:`~jaxscale.analysis.verify`
(``jaxscale plan --verify``).
"""
