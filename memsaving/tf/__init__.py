"""The TensorFlow end: reading graphs, profiling ops, rewriting and pinning the backward pass."""
