"""Tokenizer and chat template from transformers, loaded from the local model directory."""

from __future__ import annotations

import os
from functools import lru_cache

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@lru_cache(maxsize=4)
def get_tokenizer(model_path: str):
    """The HF tokenizer of a local model directory (never from a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        **kwargs) -> list[int]:
    """Render `messages` with the tokenizer's chat template; returns the token ids."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
