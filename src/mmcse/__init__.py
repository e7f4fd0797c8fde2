"""mmcse: train and compare multimodal sentence-embedding methods (SimCSE, MCSE, KDMCSE, MCSEO, DALR, DUET)."""

from mmcse.cpu_isa import pin_cpu_isa

# before torch and numpy load: the same kernels, so the same bytes, on every x86-64 CPU with AVX2 (mmcse.cpu_isa)
pin_cpu_isa()
