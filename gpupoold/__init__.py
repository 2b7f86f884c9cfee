"""gpupoold: the gpupool daemon (control plane of a GPU server)."""

__version__ = "0.1.0"
