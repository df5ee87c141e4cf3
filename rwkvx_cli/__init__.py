"""rwkvx: pretraining tool for RWKV-family recurrent language models."""

__version__ = "0.1.0"
