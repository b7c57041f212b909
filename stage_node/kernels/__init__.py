"""The kernels: batch-invariant and fused CUDA kernels (Triton), quantized matrices."""
