"""Tests that need a CUDA GPU (marked ``cuda``; skipped where none is present)."""
