"""The framework-neutral model of a training step: ops, tensors, backward units, buffer keys."""
