"""kvserve — an LLM serving stack whose KV cache can be trusted and shared by many tenants."""

__version__ = "0.1.0"
