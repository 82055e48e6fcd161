"""Frames, the tensor codec (sans-IO) and the data-plane backends.

Knows bytes and tensors, never policy.
"""
