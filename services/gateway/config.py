"""GatewayConfig: the gateway's flags (vLLM spellings) and PDSERVE_* variables, frozen once.

Precedence: command-line flag > PDSERVE_<FLAG> environment variable > default.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.services.gateway.tool_parsers import TOOL_PARSERS, check_tool_call_parser

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
CHAT_TEMPLATES_DIR = os.path.join(os.path.dirname(__file__), "chat_templates")
"""Chat templates shipped with pdserve (the default model's Hermes-style tool template)."""

# GatewayConfig fields that must be > 0 / >= 0 (0: "no limit" or "none allowed").
_POSITIVE = ("request_timeout", "rpc_timeout", "health_check_interval", "max_body_size",
             "max_n", "block_size", "responses_ttl", "kv_peer_bandwidth")
_NON_NEGATIVE = ("max_request_retries", "max_num_queued_requests", "max_queued_tokens",
                 "max_logprobs", "max_stop_strings", "max_stop_string_length",
                 "local_prefill_threshold", "max_prefill_queue_size", "grace_period",
                 "max_stream_backlog",
                 "socket_send_buffer", "stream_pause_bytes", "stream_resume_bytes",
                 "max_stream_pause_s", "kv_peer_prefill_rate", "kv_peer_overhead")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    model_path: str
    """Local HF directory holding the tokenizer and chat template."""
    served_model_name: str = DEFAULT_MODEL
    """The name clients use (OpenAI `model`); also a prefix-hash extra key for routing."""
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None
    """Prompt + output tokens; None: read from the backends' GetState."""
    prefill_urls: tuple[str, ...] = ()
    """Static prefill instances, `host:port` each (used when the registry has none)."""
    decode_urls: tuple[str, ...] = ()
    """Static decode instances, `host:port` each."""
    redis_url: str | None = None
    """The Redis prefix index; None: static lists only."""
    api_key: str | tuple[str, ...] | None = None
    """The accepted API keys (one, a tuple, or comma-separated); read them as `api_keys`.
    If any, every route but /health needs `Authorization: Bearer <one of them>`, and each
    key is a prefix-cache tenant (services/gateway/tenancy.py)."""
    admin_api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    """The operator's key(s) for /debug/* (services/gateway/admin.py); a tenant key gets
    403 there. None: those routes are open only when no --api-key is set either."""
    local_prefill_threshold: int = 0
    """Prompts whose uncached part is shorter than this go straight to a decode instance."""
    max_prefill_queue_size: int = 0
    """Prefill requests this gateway may have in flight at one prefill instance; a prompt
    placed while the chosen one has this many is prefilled on its decode instance instead
    (NVIDIA Dynamo's `max_prefill_queue_size`). 0: no bound."""
    kv_peer_bandwidth: float = 1e9
    """The peer tier (services/gateway/peer_tier.py): bytes per second between instances."""
    kv_peer_prefill_rate: float = 2000.0
    """Prompt tokens per second an instance prefills; 0: no peer fetches."""
    kv_peer_overhead: float = 0.02
    """Seconds one peer fetch costs besides its bytes."""
    runner: str = "generate"
    """"pooling": the engines serve an embedding model (--runner pooling: /v1/embeddings,
    /pooling, /score, /rerank on the prefill instances, no decode); "generate": text."""
    request_timeout: float = 600.0
    """Deadline of the Prefill and Generate calls, seconds."""
    rpc_timeout: float = 5.0
    """Deadline of the small calls (Abort, SetPaused, GetState, health checks), seconds."""
    max_body_size: int = 16 << 20
    """Largest accepted request body, bytes (413 above)."""
    max_n: int = 128
    """Largest `n` one request may ask for."""
    block_size: int = 16
    """KV block size for routing hashes when the backends do not report theirs."""
    log_level: str = "info"
    # ---- reliability (docs/reliability.md)
    max_request_retries: int = 2
    """Failovers one engine request may use (decode stream broken, prefill failed)."""
    health_check_interval: float = 1.0
    """Seconds between the gateway's grpc.health checks of every known instance."""
    max_num_queued_requests: int = 256
    """Engine requests the gateway admits beyond those running; 429 above (0: no limit)."""
    max_queued_tokens: int = 0
    """Prompt + max_tokens of the admitted but not running requests; 429 above (0: no limit)."""
    max_logprobs: int = 20
    """Largest `logprobs` / `top_logprobs` a request may ask for (as vLLM)."""
    max_stop_strings: int = 32
    """Most stop strings one request may give."""
    max_stop_string_length: int = 512
    """Longest stop string, characters."""
    grace_period: float = 25.0
    """Seconds in-flight requests get to finish on SIGTERM / Ctrl-C before they are cut."""
    max_stream_backlog: int = 64 << 10
    """Bytes of SSE output a stream may have waiting for a slow client before it is cut with
    an error event and its engine requests aborted (services/gateway/backpressure.py; 0: no
    limit)."""
    socket_send_buffer: int = 64 << 10
    """SO_SNDBUF of the client connections, bytes (Linux doubles it; 0: the kernel's
    autotuning, up to 4 MiB a connection that does not read)."""
    stream_pause_bytes: int = 16 << 10
    """Engine-side backpressure: a stream whose client has this many bytes unacknowledged
    (gateway backlog + transport + socket send queue) has its engine requests paused on
    their decode instance (backpressure.py; 0: never pause)."""
    stream_resume_bytes: int = 4 << 10
    """A paused stream is resumed once its client is at most this many bytes behind."""
    max_stream_pause_s: float = 60.0
    """A stream paused this long is cut (error event) and its requests aborted (0: never)."""
    internal_token: str | None = field(default=None, repr=False)
    """Shared secret sent as `authorization: Bearer <token>` gRPC metadata to the services
    (never in the config's repr: the gateway logs its config at start)."""
    # ---- vLLM OpenAI-server compatibility (README "Gateway flags")
    tokenizer: str | None = None
    """Local directory of the tokenizer (and chat template); None: `model_path`'s."""
    generation_config: str = "auto"
    """Default sampling parameters and extra EOS ids (vLLM's --generation-config): "auto"
    reads the model's generation_config.json, "vllm" none, or a directory holding one
    (services/gateway/generation_config.py)."""
    chat_template: str | None = field(default=None, repr=False)
    """A Jinja chat template (the text, read from --chat-template's file); None: the
    tokenizer's own."""
    enable_auto_tool_choice: bool = False
    """tool_choice "auto" is served (vLLM's flag; needs `tool_call_parser`)."""
    tool_call_parser: str | None = None
    """How the model's tool-call markup becomes tool_calls (vLLM's flag and names): hermes,
    llama3_json or mistral (services/gateway/tool_parsers/)."""
    allowed_origins: tuple[str, ...] = ("*",)
    """CORS, as vLLM's flags of the same names."""
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    protect_metrics: bool = False
    """With API keys: /metrics needs one too (default: open, as in vLLM, for Prometheus)."""
    metrics_compat: str | None = None
    """"vllm": /metrics also carries vLLM's `vllm:` names (services/gateway/metrics_compat.py)."""
    responses_ttl: float = 3600.0
    """Seconds a stored /v1/responses response lives (in Redis with --redis-url)."""

    def __post_init__(self) -> None:
        """Raises: ValueError naming the flag of the first value out of range."""
        for names, rule in ((_POSITIVE, "> 0"), (_NON_NEGATIVE, ">= 0")):
            for name in names:
                value = getattr(self, name)
                if not (value > 0 if rule == "> 0" else value >= 0):  # also refuses NaN
                    raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value}")
        if self.max_model_len is not None and not self.max_model_len > 0:
            raise ValueError(f"--max-model-len must be > 0, got {self.max_model_len}")
        if set(split_api_keys(self.admin_api_key)) & set(split_api_keys(self.api_key)):
            raise ValueError("--admin-api-key must differ from every --api-key")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             f"({', '.join(TOOL_PARSERS)})")
        check_tool_call_parser(self.tool_call_parser)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys, deduplicated, in order (empty: no authentication)."""
        return split_api_keys(self.api_key)


def _env(name: str, default):
    return os.environ.get("PDSERVE_" + name.upper(), default)


def _number(g, flag: str, kind: type, default: float, help: str | None = None) -> None:
    """`--flag` of type `kind` (int or float), defaulting to PDSERVE_<FLAG> or `default`."""
    g.add_argument(flag, type=kind, default=kind(_env(flag[2:].replace("-", "_"), default)),
                   help=help)


def _switch(g, flag: str, help: str) -> None:
    """A store_true `--flag`, on by default when PDSERVE_<FLAG> is set (but not 0 / false)."""
    g.add_argument(flag, action="store_true", help=help,
                   default=_env(flag[2:].replace("-", "_"), "") not in ("", "0", "false"))


def _split_urls(values: list[str] | None) -> tuple[str, ...]:
    """`--prefill-url a:1 --prefill-url b:2` or `--prefill-url a:1,b:2`; grpc:// is dropped."""
    out: list[str] = []
    for v in values or []:
        for part in v.split(","):
            part = part.strip().removeprefix("grpc://").removeprefix("http://").rstrip("/")
            if part:
                out.append(part)
    return tuple(dict.fromkeys(out))


def split_api_keys(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """`"k1,k2"`, `("k1", "k2,k3")` or None -> the keys (blank parts dropped, duplicates once).

    NOTE: a comma separates keys, so a key cannot contain one.
    """
    if value is None:
        return ()
    parts = [value] if isinstance(value, str) else list(value)
    keys = (k.strip() for part in parts for k in part.split(","))
    return tuple(dict.fromkeys(k for k in keys if k))


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("gateway")
    g.add_argument("--host", default=_env("host", "127.0.0.1"))
    _number(g, "--port", int, 8000)
    g.add_argument("--model", default=_env("model", DEFAULT_MODEL),
                   help="HF directory or the default model name (for the tokenizer)")
    g.add_argument("--served-model-name", default=_env("served_model_name", None))
    g.add_argument("--extra-model", action="append", default=[], metavar="NAME=PATH",
                   help="also serve NAME (instances registered under it in Redis; needs "
                        "--redis-url), tokenizer and chat template from the directory PATH; "
                        "repeatable (services/gateway/multi_model.py)")
    g.add_argument("--max-model-len", type=int, default=_env("max_model_len", None),
                   help="default: what the backends report")
    g.add_argument("--runner", default=_env("runner", "generate"),
                   choices=["auto", "generate", "pooling"],
                   help="pooling: the engines run --runner pooling (embeddings, score, rerank; "
                        "prefill instances only); auto = generate")
    g.add_argument("--prefill-url", action="append", default=None,
                   help="prefill instance host:port (repeat or comma-separate)")
    g.add_argument("--decode-url", action="append", default=None,
                   help="decode instance host:port (repeat or comma-separate)")
    g.add_argument("--redis-url", default=_env("redis_url", None))
    g.add_argument("--api-key", action="append", default=None,
                   help="accepted API key (repeat or comma-separate; also PDSERVE_API_KEY); "
                        "each key is a prefix-cache tenant")
    _number(g, "--local-prefill-threshold", int, 0)
    _number(g, "--max-prefill-queue-size", int, 0)
    _number(g, "--kv-peer-bandwidth", float, 1e9,
            "the peer tier: bytes/s between instances (fetch a prefix a peer holds when that "
            "beats computing it)")
    _number(g, "--kv-peer-prefill-rate", float, 2000.0,
            "the peer tier: prompt tokens/s one instance prefills (0: never fetch from a peer)")
    _number(g, "--kv-peer-overhead", float, 0.02,
            "the peer tier: seconds one fetch costs besides its bytes")
    _number(g, "--request-timeout", float, 600)
    _number(g, "--rpc-timeout", float, 5)
    _number(g, "--max-body-size", int, 16 << 20)
    _number(g, "--block-size", int, 16)
    _number(g, "--responses-ttl", float, 3600.0,
            "seconds a stored /v1/responses response lives (Redis with --redis-url)")
    g.add_argument("--log-level", default=_env("log_level", "info"))
    g = parser.add_argument_group("reliability")
    _number(g, "--max-request-retries", int, 2, "failovers one engine request may use")
    _number(g, "--health-check-interval", float, 1.0,
            "seconds between health checks of the instances")
    _number(g, "--max-num-queued-requests", int, 256,
            "queued engine requests before 429 (0: no limit)")
    _number(g, "--max-queued-tokens", int, 0,
            "queued prompt + max_tokens before 429 (0: no limit)")
    _number(g, "--max-logprobs", int, 20)
    _number(g, "--max-stop-strings", int, 32)
    _number(g, "--max-stop-string-length", int, 512)
    _number(g, "--grace-period", float, 25.0,
            "seconds in-flight requests get to finish on shutdown")
    _number(g, "--max-stream-backlog", int, 64 << 10,
            "bytes of output a stream may have waiting for a slow client before it is cut "
            "with an error and its request aborted (0: no limit)")
    _number(g, "--socket-send-buffer", int, 64 << 10,
            "SO_SNDBUF of client connections, bytes (0: the kernel's autotuning)")
    _number(g, "--stream-pause-bytes", int, 16 << 10,
            "bytes a client may be behind before its stream's engine requests are paused on "
            "the decode instance (0: never pause)")
    _number(g, "--stream-resume-bytes", int, 4 << 10,
            "bytes behind at which a paused stream is resumed")
    _number(g, "--max-stream-pause-s", float, 60.0,
            "seconds a stream may stay paused before it is cut and its request aborted (0: no "
            "limit)")
    g.add_argument("--internal-token", default=_env("internal_token", None),
                   help="shared secret the prefill and decode services require")
    g.add_argument("--admin-api-key", action="append", default=None,
                   help="the operator's key for /debug/* (repeat or comma-separate; also "
                        "PDSERVE_ADMIN_API_KEY); a tenant's --api-key gets 403 there")
    add_compat_args(parser)
    return parser


def _json_list(text: str | list[str]) -> list[str]:
    """vLLM's CORS flags take a JSON list ('["*"]'); a bare comma list works too."""
    if isinstance(text, list):
        return text
    text = text.strip()
    if text.startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text}")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    """The flags vLLM's OpenAI server has, with its spellings (also `pdserve up`'s)."""
    g = parser.add_argument_group("OpenAI server (vLLM spellings)")
    g.add_argument("--tokenizer", default=_env("tokenizer", None),
                   help="local tokenizer directory (default: the model's)")
    g.add_argument("--generation-config", default=_env("generation_config", "auto"),
                   help="default sampling parameters and extra EOS ids, as vLLM: 'auto' "
                        "(the model's generation_config.json), 'vllm' (none), or a "
                        "directory holding a generation_config.json")
    g.add_argument("--chat-template", default=_env("chat_template", None),
                   help="a Jinja chat template: a file path, the template itself, or the "
                        "name of one shipped in services/gateway/chat_templates/ (e.g. "
                        "tool_chat_template_smollm2_hermes.jinja)")
    _switch(g, "--enable-auto-tool-choice", 'serve tool_choice "auto" (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", metavar="{" + ",".join(TOOL_PARSERS) + "}",
                   default=_env("tool_call_parser", None),
                   help="how tool calls are read from the model's output (an unknown name "
                        "is refused at start-up, in one line)")
    for what in ("origins", "methods", "headers"):
        g.add_argument(f"--allowed-{what}", type=_json_list,
                       default=_json_list(_env(f"allowed_{what}", '["*"]')),
                       help=f'CORS allowed {what}, a JSON list (default ["*"])')
    _switch(g, "--allow-credentials", "CORS: allow credentials")
    _switch(g, "--protect-metrics", "with --api-key, /metrics needs a key too (default: open)")
    g.add_argument("--metrics-compat", choices=["vllm"], default=_env("metrics_compat", None),
                   help="vllm: /metrics also carries vLLM's `vllm:` metric names")


def _tokenizer_dir(value: str | None) -> str | None:
    """--tokenizer: a local directory holding tokenizer.json, or a model name / .gguf."""
    if not value:
        return None
    if os.path.isfile(os.path.join(value, "tokenizer.json")):
        return value
    from pdserve.shared.models.convert import resolve_model_path

    try:
        return str(resolve_model_path(value, convert=False))
    except FileNotFoundError as e:  # name the flag: the message says "model ..." otherwise
        raise FileNotFoundError(f"--tokenizer: {e}") from None


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text (a bare name may be one of CHAT_TEMPLATES_DIR), or the
    value itself when it is a template (as vLLM).

    Raises:
        FileNotFoundError: a path-like value (no Jinja braces) that names no file.
    """
    if not value:
        return None
    shipped = os.path.join(CHAT_TEMPLATES_DIR, value)
    if not os.path.isfile(value) and os.sep not in value and os.path.isfile(shipped):
        value = shipped
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise FileNotFoundError(f"--chat-template: no such file: {value}")
    return value


def config_from_cli_args(ns: argparse.Namespace) -> GatewayConfig:
    """Resolve the model directory and freeze the config.

    Raises:
        FileNotFoundError: the model is not a local directory and was never converted.
        ValueError: a flag's value is out of range (the message names the flag).
    """
    from pdserve.shared.models.convert import resolve_model_path

    # NOTE: convert=False: conversion imports torch; the engine services convert first.
    model_path = str(resolve_model_path(ns.model, convert=False))
    name = ns.served_model_name or (
        ns.model if os.sep not in ns.model else os.path.basename(model_path.rstrip(os.sep)))
    same_names = {name: getattr(ns, name) for name in GatewayConfig.__dataclass_fields__
                  if hasattr(ns, name)}
    return GatewayConfig(**{
        **same_names, "model_path": model_path, "served_model_name": name,
        "max_model_len": int(ns.max_model_len) if ns.max_model_len else None,
        "prefill_urls": _split_urls(ns.prefill_url or [_env("prefill_url", "")]),
        "decode_urls": _split_urls(ns.decode_url or [_env("decode_url", "")]),
        "redis_url": ns.redis_url or None, "runner": "pooling" if ns.runner == "pooling"
        else "generate",
        "api_key": split_api_keys(ns.api_key or _env("api_key", None)) or None,
        "admin_api_key": split_api_keys(ns.admin_api_key or _env("admin_api_key", None)) or None,
        "internal_token": ns.internal_token or None, "tokenizer": _tokenizer_dir(ns.tokenizer),
        "generation_config": _generation_config_source(ns.generation_config),
        "chat_template": read_chat_template(ns.chat_template),
        **{f"allowed_{what}": tuple(getattr(ns, f"allowed_{what}"))
           for what in ("origins", "methods", "headers")}})


def _generation_config_source(value: str) -> str:
    """--generation-config as given, after checking a directory holds the file."""
    if value in ("auto", "vllm"):
        return value
    if not (Path(value) / "generation_config.json").is_file():
        raise FileNotFoundError(f"--generation-config: no generation_config.json in {value!r} "
                                "(give 'auto', 'vllm' or such a directory)")
    return value
