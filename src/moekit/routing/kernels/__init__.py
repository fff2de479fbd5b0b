"""@triton.jit code only: the router GEMM (with its fused top-k epilogue) and the routing kernel."""
