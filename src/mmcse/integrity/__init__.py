"""Integrity: cached sets, images and checkpoints checked; which configuration made an artifact."""
