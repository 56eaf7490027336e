"""StructuredOutputsParams: one request's output constraint, as vLLM spells it (torch-free).

Exactly one constraint is set:

    json            a JSON schema, as JSON text (`canonical_json`: compact)
    json_object     any JSON object (OpenAI's response_format {"type": "json_object"})
    regex           a regular expression the whole output matches
    choice          the output is exactly one of these strings
    grammar         an EBNF grammar (xgrammar's dialect, GBNF-like: `root ::= ...`)
    structural_tag  an xgrammar structural tag, as JSON text (tool calls use it)

`key` identifies the compiled grammar (the cache key): two requests with the same key share
one compilation. The text of each constraint is checked only for type and size here; the
compiler (shared/structured_output/backend.py) is the judge of its content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_SPEC_CHARS = 256 * 1024
"""Longest constraint text (schema, regex, grammar, all choices together) accepted."""
MAX_CHOICES = 1024

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | None = None
    """A JSON schema as JSON text (`canonical_json` makes equal schemas one cache key)."""
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    """JSON: no free whitespace between tokens (compact `{"a": 1, "b": 2}` only)."""
    _key: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        self._verify()
        object.__setattr__(self, "_key", (self.kind, self.spec, self.disable_any_whitespace))

    @property
    def kind(self) -> str:
        """Which constraint is set: one of json, json_object, regex, choice, grammar,
        structural_tag."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))  # `_verify`: one

    @property
    def spec(self) -> str:
        """The constraint as one string (choices JSON-encoded)."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice or ()), ensure_ascii=False)
        return getattr(self, kind)

    @property
    def key(self) -> tuple:
        """Identifies the compiled grammar: equal keys compile to the same grammar."""
        return self._key

    def _verify(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs: exactly one of json, json_object, regex, "
                             f"choice, grammar, structural_tag must be set, got {set_kinds}")
        kind = set_kinds[0]
        value = getattr(self, kind)
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
            return
        if kind == "choice":
            if not isinstance(value, tuple) or not value or not all(
                    isinstance(c, str) and c for c in value):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(value)} entries; at "
                                 f"most {MAX_CHOICES} are allowed")
            size = sum(map(len, value))
        else:
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
            size = len(value)
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} has {size} characters; at most "
                             f"{MAX_SPEC_CHARS} are allowed")


def canonical_json(value: object) -> str:
    """Compact JSON text: one cache key per schema, however the client spaced it.

    NOTE: property order matters to the grammar (xgrammar emits properties in the schema's
    order), so `sort_keys` would change outputs; only whitespace is normalized.
    """
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
