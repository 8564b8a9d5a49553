"""kvserve.server.tools: tool calling: flags, per-model parsers, the tool-call text of chat
answers."""
