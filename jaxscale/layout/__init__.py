"""Layout: a rules table on a mesh: logical names to mesh axes, jax shardings, the mesh itself."""
