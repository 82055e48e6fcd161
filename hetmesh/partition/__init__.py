"""Models cut into units (embedding, decoder layers, head) and stages that hold a unit range.

Knows models and tensors, never the network.
"""
