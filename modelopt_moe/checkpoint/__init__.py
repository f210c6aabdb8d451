"""Distributed checkpoints: EP-aware sharded amax and quantization state."""
