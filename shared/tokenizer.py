"""Tokenizer and chat template from transformers, loaded from the local model directory.

NOTE: `transformers.AutoTokenizer` imports torch (transformers 5.x); the fast tokenizer
class builds the same tokenizer and chat template from `tokenizer.json` without it, so the
gateway and the engine share one torch-free loader.
"""

from __future__ import annotations

import os
from functools import lru_cache

from pdserve.shared.chat_encoding import encode_chat

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@lru_cache(maxsize=4)
def get_tokenizer(model_path: str):
    """The fast HF tokenizer of a local model directory (never from a hub, never torch)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_path, local_files_only=True)


def apply_chat_template(tokenizer, messages: list[dict],
                        add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered with the chat template.

    Message contents are ordinary text: chat-marker strings typed by a user are never
    control tokens (the same encoding as the gateway's, so answers match token for token).
    """
    return encode_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt)
