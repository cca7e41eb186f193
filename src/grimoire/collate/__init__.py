"""Collation: a micro-batch's rows become tensors, padded or packed."""
