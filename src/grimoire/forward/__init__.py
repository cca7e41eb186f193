"""Forward: per-token log-probs from the model (fused, chunked head), the reference model and precomputed reference log-probs."""
