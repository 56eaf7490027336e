"""XgrammarBackend: compiles StructuredOutputsParams into xgrammar grammars; matchers, bitmasks.

xgrammar (the default backend of vLLM and SGLang) turns a grammar into a pushdown automaton
over the tokenizer's vocabulary. Per request a `GrammarMatcher` tracks the state; each step it
fills that request's row of a token bitmask ([num_rows, ceil(vocab_size / 32)] int32, bit 1
= allowed), and the bitmask sets the disallowed logits to -inf. The EOS token is allowed
exactly where the grammar accepts the output so far.

Everything heavy is lazy: importing xgrammar and building its tokenizer info (~0.4 s) happen
on the first compile, in the compile thread, never at engine start-up.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch

from pdserve.shared.structured_output.params import StructuredOutputsParams

_WHAT = {"json": "invalid JSON schema", "json_object": "JSON object grammar",
         "regex": "invalid regex", "choice": "invalid choice", "grammar": "invalid grammar",
         "structural_tag": "invalid structural tag"}
_LOG_PREFIX = re.compile(r"^\s*\[[\d:. ]+\]\s*\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false:\s*")
MAX_WHITESPACE_CNT = 4
"""JSON grammars allow at most this many whitespace characters in a row (between tokens):
enough for any indentation a model uses on one line, and a small model can no longer spend
its whole max_tokens on newlines inside an unfinished object."""


def compile_error_text(exc: BaseException) -> str:
    """xgrammar's error message without its C++ log prefix ("[12:00:00] file.cc:42: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose only sentences are `choices` (JSON string escapes are xgrammar's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary (the model's logits width).

    Args:
        tokenizer_path: local directory of the model's tokenizer.
        vocab_size: columns of the logits (may exceed the tokenizer's vocabulary).
        max_threads: threads xgrammar may use for one compilation.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, max_threads: int = 1) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.max_threads = max_threads
        self._lock = threading.Lock()
        self._compiler: Any = None

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                from pdserve.shared.tokenizer import get_tokenizer

                info = xgr.TokenizerInfo.from_huggingface(
                    get_tokenizer(self.tokenizer_path), vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads,
                                                     cache_enabled=False)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params`.

        Raises:
            ValueError: the constraint does not compile ("invalid JSON schema: ...").
        """
        compiler = self._get_compiler()
        kind = params.kind
        json_format = dict(any_whitespace=not params.disable_any_whitespace,
                           max_whitespace_cnt=None if params.disable_any_whitespace
                           else MAX_WHITESPACE_CNT)
        try:
            if kind == "json":
                return compiler.compile_json_schema(params.json, **json_format)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', **json_format)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice or ()))
            if kind == "grammar":
                return compiler.compile_grammar(params.grammar)
            return compiler.compile_structural_tag(
                _cap_tag_whitespace(params.structural_tag, json_format["max_whitespace_cnt"]))
        except Exception as e:  # xgrammar raises RuntimeError / pydantic errors
            raise ValueError(f"{_WHAT[kind]}: {compile_error_text(e)}") from None

    def new_matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        """In place: -inf at the disallowed tokens of `rows` of logits ([n, vocab] float)."""
        import xgrammar as xgr

        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                        indices=rows)


def _cap_tag_whitespace(structural_tag: str | None, max_whitespace_cnt: int | None) -> str | None:
    """The structural tag with `max_whitespace_cnt` set on each JSON-schema format that does
    not set it, so a forced tool call's arguments obey the same whitespace cap as
    `response_format` JSON (without it a model can fill max_tokens with blanks inside the
    arguments). A tag that is not valid JSON is returned as is (the compiler names it)."""
    if not structural_tag or max_whitespace_cnt is None:
        return structural_tag
    try:
        tag = json.loads(structural_tag)
    except ValueError:
        return structural_tag

    def cap(node):
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and node.get("style", "json") == "json":
                node.setdefault("max_whitespace_cnt", max_whitespace_cnt)
            for value in node.values():
                cap(value)
        elif isinstance(node, list):
            for value in node:
                cap(value)

    cap(tag)
    return json.dumps(tag)
