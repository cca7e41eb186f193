"""The optimizer stage: optimizers, parameter groups, schedulers, gradient clipping and rescaling."""
