"""Ops: array kernels below the models and the explicit parallelism: lean norms, losses, MoE routing."""
