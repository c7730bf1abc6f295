"""The train layer: run config, the jitted step, the loop, checkpoints, the run directory and
the frozen held-out set. Deliberately empty: ``clozax.train.hostmem`` must be importable
before JAX is (see its docstring), so nothing here may import JAX at package import."""
