"""Training: the loop, its set-up, metrics and normalisation, callbacks, checkpoints and run records."""
