"""Parallelism on torch's own engine: FSDP2 sharding, DCP checkpoints, preemption signals, the launcher."""
