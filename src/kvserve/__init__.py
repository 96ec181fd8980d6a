"""kvserve: an LLM serving system in Python, from the HTTP gateway down to the paged KV cache."""

__version__ = "0.1.0"
