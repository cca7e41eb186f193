"""Normalisation: loss units, token counts, and the one cross-rank reduction of a step."""
