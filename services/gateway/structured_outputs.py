"""An OpenAI request's output constraint -> the engine's StructuredOutputsParams.

Spellings, as vLLM's OpenAI server takes them (one source per request):

    response_format   {"type": "text" | "json_object"}
                      {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    structured_outputs {"json": schema, "regex": str, "choice": [str], "grammar": str,
                        "json_object": true, "structural_tag": str | object,
                        "disable_any_whitespace": bool}
    guided_json, guided_regex, guided_choice, guided_grammar   (vLLM's older fields)

The shapes are checked here (400 naming the field); whether a schema, regex or grammar
compiles is the engine's call: its INVALID_ARGUMENT comes back as a 400 naming the field the
constraint came from (`name_param`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TypeVar

from pdserve.services.gateway.errors import GatewayError, bad_request
from pdserve.services.gateway.protocol import SamplingRequest
from pdserve.shared.structured_output.params import StructuredOutputsParams, canonical_json

_T = TypeVar("_T")
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_IGNORED_KEYS = frozenset({"backend", "whitespace_pattern", "disable_fallback",
                           "disable_additional_properties"})
"""vLLM's structured_outputs options that do not apply here (one backend: xgrammar)."""
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def schema_text(value: object, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as compact JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return canonical_json(value)


def _from_response_format(rf: dict) -> dict | None:
    kind = rf.get("type", "text")
    if kind not in _RESPONSE_FORMATS:
        raise bad_request(f"response_format.type must be one of {list(_RESPONSE_FORMATS)}, "
                          f"got {kind!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with a 'schema'",
                          "response_format")
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is None:
        raise bad_request("response_format.json_schema.schema is required", "response_format")
    return {"json": schema_text(schema, "response_format")}


def _from_structured_outputs(so: dict) -> dict:
    unknown = set(so) - set(_CONSTRAINTS) - {"disable_any_whitespace"} - _IGNORED_KEYS
    if unknown:
        raise bad_request(f"structured_outputs: unknown field(s) {sorted(unknown)}",
                          "structured_outputs")
    out = {k: so[k] for k in _CONSTRAINTS if so.get(k) not in (None, False)}
    if "json" in out:
        out["json"] = schema_text(out["json"], "structured_outputs")
    if isinstance(out.get("structural_tag"), dict):
        out["structural_tag"] = canonical_json(out["structural_tag"])
    if "disable_any_whitespace" in so:
        if not isinstance(so["disable_any_whitespace"], bool):
            raise bad_request("structured_outputs.disable_any_whitespace must be a boolean",
                              "structured_outputs")
        out["disable_any_whitespace"] = so["disable_any_whitespace"]
    return out


def resolve_structured_outputs(req: SamplingRequest
                               ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None: unconstrained).

    Raises:
        GatewayError: 400 naming the field: a bad shape, or several sources at once.
    """
    sources: list[tuple[str, dict]] = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format)
        if spec is not None:
            sources.append(("response_format", spec))
    if req.structured_outputs:
        sources.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            sources.append((name, {kind: schema_text(value, name) if kind == "json" else value}))
    if not sources:
        return None, None
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise bad_request(f"only one of {names} may constrain the output", names[1])
    param, spec = sources[0]
    if isinstance(spec.get("choice"), list):
        spec["choice"] = tuple(spec["choice"])
    try:
        return StructuredOutputsParams(**spec), param
    except (TypeError, ValueError) as e:
        message = str(e).replace("structured_outputs", param, 1)
        raise bad_request(message, param) from None


async def name_param(deltas: AsyncIterator[_T], param: str) -> AsyncIterator[_T]:
    """`deltas`, with an engine's 400 (the constraint does not compile) naming `param`."""
    async with aclosing(deltas) as inner:  # type: ignore[type-var]
        try:
            async for delta in inner:
                yield delta
        except GatewayError as e:
            if e.status_code == 400 and e.param is None:
                e.param = param
                e.message = f"{param}: {e.message}"
                e.args = (e.message,)
            raise
