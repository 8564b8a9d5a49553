"""The one exception the model layer raises for a user's mistake."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model argument, checkpoint, config or tokenizer that kvserve cannot use.

    The message always names what was wrong (file, key or tensor) and what would work instead, so
    the CLI and server can show it to the user verbatim.
    """
