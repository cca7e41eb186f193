"""After a run: ``grimoire plot``, ``grimoire generate``, ``grimoire merge-lora``."""
