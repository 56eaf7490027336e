"""Small helpers for the gateway tests: SSE parsing and request shorthands."""

from __future__ import annotations

import json

import httpx

from tests.services.gateway.conftest import SERVED_MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(content: str = "Say hi.", **kwargs) -> dict:
    return {"model": SERVED_MODEL, "messages": [{"role": "user", "content": content}], **kwargs}


def completion_body(prompt="Hello", **kwargs) -> dict:
    return {"model": SERVED_MODEL, "prompt": prompt, **kwargs}


def parse_sse(text: str) -> list:
    """The `data:` payloads of an event stream (JSON decoded, "[DONE]" kept as a string).

    Asserts the framing: every event is exactly one `data: ...` line ended by a blank line.
    """
    assert text.endswith("\n\n"), "stream must end with a complete event"
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, repr(block)
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def stream(http: httpx.AsyncClient, path: str, body: dict) -> list:
    r = await http.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def streamed_texts(chunks: list, chat: bool) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            piece = (ch["delta"].get("content") or "") if chat else ch["text"]
            out[ch["index"]] = out.get(ch["index"], "") + piece
    return out


def finish_reasons(chunks: list) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for c in chunks:
        for ch in c["choices"]:
            if ch["finish_reason"] is not None:
                out.setdefault(ch["index"], []).append(ch["finish_reason"])
    return out


def assert_error_object(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], (str, int))
    return err
