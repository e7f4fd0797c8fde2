"""Settings for the GPU tests, applied before any of them creates a CUDA context."""

import os

# Deterministic cuBLAS (torch.use_deterministic_algorithms, which train() switches on, needs
# this set before the first cuBLAS handle exists): the resume test compares weights.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
