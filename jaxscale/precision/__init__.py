"""Precision: the mixed-precision policy and the fp8 projections."""
