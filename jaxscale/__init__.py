"""jaxscale: a JAX/XLA SPMD training stack; layouts are rules tables, not code.

The programmatic API (importing it imports jax; ``simulate_devices`` does not)::

    import jaxscale

    jaxscale.simulate_devices(8)  # CPU devices for the mesh, before jax starts (no accelerator needed)

    from jaxscale.config import load_config
    from jaxscale.train import Trainer   # Trainer.build(config), .init_state(), .step(), .fit()
"""

from jaxscale.simulate import simulate_devices

__all__ = ["simulate_devices"]
