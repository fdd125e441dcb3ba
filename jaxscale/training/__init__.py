"""Training: the trainer, its step, the loop around it, the optimizer and the metrics it records."""
