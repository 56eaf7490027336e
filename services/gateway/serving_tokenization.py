"""POST /tokenize and /detokenize (vLLM's request and response shapes)."""

from __future__ import annotations

from pdserve.services.gateway.errors import GatewayError, bad_request
from pdserve.services.gateway.protocol import DetokenizeRequest, TokenizeRequest
from pdserve.services.gateway.sampling import check_token_ids
from pdserve.services.gateway.serving_chat import ChatServing

_NO_LIMIT = 10**8
"""transformers' model_max_length when a tokenizer declares none is ~1e30."""


class TokenizationServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat
        self.tokenizer = chat.tokenizer

    async def max_model_len(self) -> int | None:
        try:
            return (await self.chat.engine.engine_info()).max_model_len
        except GatewayError:
            return self.chat.config.max_model_len

    async def tokenize(self, req: TokenizeRequest) -> dict:
        self.chat.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        max_model_len = await self.max_model_len()
        # No engine answering and no flag: the tokenizer's own limit bounds the text.
        context = max_model_len or getattr(self.tokenizer.tokenizer, "model_max_length", 0)
        if 0 < context < _NO_LIMIT:  # refuse hopeless text before it holds the tokenizer
            num_chars = len(req.prompt) if req.messages is None else \
                sum(len(m.text()) for m in req.messages)
            await self.chat.check_prompt_chars(
                num_chars, "prompt" if req.messages is None else "messages", context)
        if req.messages is not None:
            token_ids = await self.chat.encode_messages(req)
            if req.add_special_tokens:
                token_ids = self.tokenizer.tokenizer.build_inputs_with_special_tokens(token_ids)
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            token_ids = await self.tokenizer.encode_prompt(req.prompt, add_special)
        out = {"count": len(token_ids), "max_model_len": max_model_len,
               "tokens": token_ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.token_strs(token_ids)
        return out

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.chat.check_model(req.model)
        check_token_ids(req.tokens, self.tokenizer.vocab_size, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}
