"""speccompile: compile an LLM plus a drafter into deployable artifacts and run exact speculative decoding."""

__version__ = "0.1.0"
