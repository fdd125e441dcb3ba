"""Inference: tokens from a trained state: sampling and the generate command."""
