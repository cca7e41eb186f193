"""Batching: what a row costs (the token budget), which rows train together at a step (step planner, bin packing) and the loader that drives them."""
