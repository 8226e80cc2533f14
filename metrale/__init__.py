"""Metrale: an LLM inference server with its own engine and CUDA kernels."""
__version__ = "0.1.0"
