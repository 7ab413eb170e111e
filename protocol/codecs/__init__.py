"""Tensor codecs: the registry keyed by envelope codec id, the quantization and TopK kernels, error feedback."""
