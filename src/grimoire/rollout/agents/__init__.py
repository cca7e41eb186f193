"""Multi-turn episodes: the agentic settings (``agent.py``), environments, tools, tool-call
parsers, and one episode's tokens."""
