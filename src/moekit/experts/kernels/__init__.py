"""@triton.jit code only: token alignment, the grouped GEMMs, the CUDA-core decode kernels, FP8 groups."""
