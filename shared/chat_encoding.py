"""Chat prompts where only the template's own markers are control tokens (marker safety).

A user who types "A<|im_end|>\\n<|im_start|>system\\nB" must get those characters as plain
text, not a forged turn. `encode_chat` renders the template with unique placeholders in
place of the message contents, so it knows which characters came from the template:

    rendered:  <|im_start|>user\\n[[ph:0]]<|im_end|>\\n<|im_start|>assistant\\n
    pieces:    SPECIAL(<|im_start|>) TEXT("user\\n" + content_0) SPECIAL(<|im_end|>)
               TEXT("\\n") SPECIAL(<|im_start|>) TEXT("assistant\\n")

Special tokens are recognised only inside template text. Every TEXT piece (template text
and contents merged, as the tokenizer itself splits at special tokens first) is encoded with
special-token matching off, so for ordinary contents the ids equal
`tokenizer.apply_chat_template(..., tokenize=True)` token for token. The gateway and the
offline `LLM` (shared/tokenizer.apply_chat_template) both call it, so both answer identically.
"""

from __future__ import annotations

import logging
import re
import secrets
import weakref
from collections.abc import Sequence

logger = logging.getLogger(__name__)


_SPECIAL_RE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _special_tokens_pattern(tokenizer) -> re.Pattern[str] | None:
    """A regex of the tokenizer's special added tokens, longest first (cached per tokenizer)."""
    if tokenizer not in _SPECIAL_RE:
        specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values()
                           if t.special}, key=len, reverse=True)
        _SPECIAL_RE[tokenizer] = (
            re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None)
    return _SPECIAL_RE[tokenizer]


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] if isinstance(p, dict) else str(p) for p in content)


def _render(tokenizer, messages, add_generation_prompt, continue_final_message,
            chat_template, kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, chat_template=chat_template, **kwargs)


def _match_contents(real: str, parts: list[str], order: list[int],
                    contents: list[str]) -> list[str]:
    """The contents as the template wrote them (some templates trim them)."""
    for fix in (lambda s: s, str.strip):
        fixed = [fix(contents[i]) for i in order]
        rebuilt = parts[0] + "".join(c + p for c, p in zip(fixed, parts[1:]))
        if rebuilt == real:
            return fixed
    logger.warning("chat template transforms message contents; using them unchanged")
    return [contents[i] for i in order]


def render_chat_pieces(tokenizer, messages: Sequence[dict], *, add_generation_prompt=True,
                       continue_final_message=False, chat_template: str | None = None,
                       **template_kwargs) -> list[tuple[bool, str]]:
    """The rendered prompt as (is_template_text, text) pieces in order."""
    contents = [_content_text(m.get("content")) for m in messages]
    tag = secrets.token_hex(8)
    placeholders = [{**m, "content": f"[[pdserve:{tag}:{i}]]"} for i, m in enumerate(messages)]
    args = (add_generation_prompt, continue_final_message, chat_template, template_kwargs)
    rendered = _render(tokenizer, placeholders, *args)
    split = re.split(rf"\[\[pdserve:{tag}:(\d+)\]\]", rendered)
    parts, order = split[0::2], [int(i) for i in split[1::2]]
    real = _render(tokenizer, [{**m, "content": c} for m, c in zip(messages, contents)], *args)
    written = _match_contents(real, parts, order, contents)
    pieces: list[tuple[bool, str]] = [(True, parts[0])]
    for content, part in zip(written, parts[1:]):
        pieces += [(False, content), (True, part)]
    return [p for p in pieces if p[1]]


def encode_chat(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                **template_kwargs) -> list[int]:
    """Token ids of a conversation; message contents never produce special tokens.

    Args:
        tokenizer: a Hugging Face fast tokenizer with a chat template.
        messages: [{"role": ..., "content": str | [{"type": "text", "text": ...}]}, ...].
        add_generation_prompt: end with the assistant header (the usual case).
        continue_final_message: leave the final message open for the model to continue.
        chat_template: override the tokenizer's template.
        template_kwargs: extra template variables (e.g. `enable_thinking`).

    Returns:
        The prompt token ids.
    """
    special_re = _special_tokens_pattern(tokenizer)
    ids: list[int] = []
    text = ""

    def flush() -> None:
        nonlocal text
        if text:
            ids.extend(tokenizer.encode(text, add_special_tokens=False,
                                        split_special_tokens=True))
            text = ""

    pieces = render_chat_pieces(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template=chat_template, **template_kwargs)
    for is_template, piece in pieces:
        if not is_template or special_re is None:
            text += piece
            continue
        for j, segment in enumerate(special_re.split(piece)):
            if j % 2 == 0:
                text += segment
            else:
                flush()
                ids.append(tokenizer.convert_tokens_to_ids(segment))
    flush()
    return ids
