"""The tiny random model the harness tests launch: the demo tokenizer (word-level vocabulary)
on a much smaller network, so a server starts and answers in seconds."""

from __future__ import annotations

from kvserve.model import demo_model_config

TINY = demo_model_config() | {"hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2}
