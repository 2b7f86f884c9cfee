"""gpupool client: run unmodified CUDA programs on a remote GPU served by gpupoold."""

__version__ = "0.1.0"
