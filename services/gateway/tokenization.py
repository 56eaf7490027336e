"""The gateway's tokenizer: loaded without torch, encoding off the event loop.

NOTE: `transformers.AutoTokenizer` imports torch (through `configuration_utils` ->
`modeling_rope_utils` in transformers 5.x), which would cost the gateway ~1 GiB and seconds
of start-up. `PreTrainedTokenizerFast.from_pretrained` builds the same fast tokenizer (and
chat template) from `tokenizer.json` without importing torch, so the gateway uses that.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from pdserve.shared.chat_encoding import encode_chat
from pdserve.shared.tokenizer import get_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_tokenizer(model_path: str):
    """The fast tokenizer of a local model directory (never from a hub, never torch)."""
    return get_tokenizer(model_path)


class GatewayTokenizer:
    """Encode prompts (in one worker thread) and decode tokens (inline, they are tiny).

    NOTE: one worker thread, because `split_special_tokens` toggles a flag on the shared
    Rust tokenizer; encodes must not interleave.
    """

    def __init__(self, tokenizer, chat_template: str | None = None) -> None:
        """`chat_template`: replaces the tokenizer's own (--chat-template)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._backend = tokenizer.backend_tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._token_text: dict[int, str] = {}
        self.vocab_size = len(tokenizer)
        self.eos_token_id: int | None = tokenizer.eos_token_id

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw completion prompt: special tokens in it are parsed (the user owns it)."""
        return await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_chat(self, messages: Sequence[dict], **kwargs) -> list[int]:
        if self.chat_template is not None:
            kwargs.setdefault("chat_template", self.chat_template)
        return await self._run(encode_chat, self.tokenizer, messages, **kwargs)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template reads the `tools` variable (else tools cannot reach
        the prompt)."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str):
            return False
        import jinja2
        import jinja2.meta

        try:
            names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
        except jinja2.TemplateError:  # extension tags plain Jinja does not know
            return "tools" in template
        return "tools" in names

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token on its own (logprobs entries); special tokens keep their text."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._backend.decode(
                [token_id], skip_special_tokens=False)
        return text

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(list(token_ids))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
