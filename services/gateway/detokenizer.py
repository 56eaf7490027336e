"""Incremental detokenization: text pieces that never split a UTF-8 character, and lose nothing.

A byte-level token may hold half of a character ("你" is three bytes, often two tokens), so
decoding token by token would emit U+FFFD. We decode a small window instead (vLLM's
prefix/read offsets):

    token_ids:  [ ... | prefix_offset ....... | read_offset ........ ]
                        already emitted text   not yet emitted
    new text = decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])

and hold the new text back while it ends in U+FFFD (an incomplete character). `flush()` at
the end emits whatever is still held, so the concatenation of all pieces equals
`decode(output_token_ids)`. A few prompt tokens seed the window so that tokenizers which
drop a leading space at the start of a decode (SentencePiece) still space the first word.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._decoder = decoder
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, final: bool) -> str:
        new_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text):
            return ""
        if not final and new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # an incomplete character: wait for its remaining bytes
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        return delta

    def step(self, token_id: int) -> str:
        """Add one token; returns the text that became final (may be "")."""
        self._token_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of generation: the held-back text, even an incomplete character (as U+FFFD)."""
        return self._advance(final=True)
