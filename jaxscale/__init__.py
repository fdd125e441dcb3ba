"""jaxscale: a JAX/XLA SPMD training stack; layouts are rules tables, not code.

The programmatic API (importing it imports jax)::

    from jaxscale.config import load_config
    from jaxscale.train import Trainer   # Trainer.build(config), .init_state(), .step(), .fit()
"""
