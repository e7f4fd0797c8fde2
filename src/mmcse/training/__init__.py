"""Training: the loops, batches, checkpoints and the divergence watch."""
