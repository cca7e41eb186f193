"""The command line: ``grimoire train`` / ``validate`` and the YAML schema that mirrors the Python API."""
