"""Runtime: the process around the step: XLA flags, simulated devices, multi-host start-up, the run lock."""
