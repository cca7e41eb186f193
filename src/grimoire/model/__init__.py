"""Model preparation: precision, activation checkpointing, packed attention, compile, Liger, NEFTune, OSFT."""
