"""mmcse: train and compare multimodal sentence-embedding methods (SimCSE, MCSE, KDMCSE, MCSEO, DALR, DUET)."""
