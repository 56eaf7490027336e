"""Tokenizer and chat template from transformers, loaded from the local model directory.

NOTE: `transformers.AutoTokenizer` imports torch (transformers 5.x); the fast tokenizer
class builds the same tokenizer and chat template from `tokenizer.json` without it, so the
gateway and the engine share one torch-free loader.
"""

from __future__ import annotations

import os
from functools import lru_cache

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@lru_cache(maxsize=4)
def get_tokenizer(model_path: str):
    """The fast HF tokenizer of a local model directory (never from a hub, never torch)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_path, local_files_only=True)
