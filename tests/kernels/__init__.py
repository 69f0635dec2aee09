"""Kernels (kernels/) against their PyTorch references, on the CPU through the Triton interpreter."""
