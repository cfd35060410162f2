"""The tiny Hugging Face models tests convert: small enough to build in a second, with grouped-query
attention so the layout transforms have something to do."""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama_config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


def tiny_llama(dtype: torch.dtype = torch.float32) -> Any:
    """A ``LlamaForCausalLM`` initialized from seed 0, in eval mode."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config()).to(dtype).eval()
