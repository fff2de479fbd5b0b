"""@triton.jit code only. Host code (validation, configs, launches) lives in the public modules."""
