"""Every PDSERVE_* variable checked before any command reads it: one line naming it, exit 2.

A variable PDSERVE_FOO_BAR is the environment form of a flag --foo-bar of some `pdserve`
subcommand (shared/engine_args.py, services/common/config.py, services/gateway/config.py,
services/launcher/config.py). Its value must parse as that flag's `type`, be one of its
`choices`, or be a yes/no word for a switch; a few values get a stricter parser (sizes,
core lists, ports, JSON lists). Variables that name no flag (compose's PDSERVE_PUBLISH,
PDSERVE_TAG ...) are left alone unless listed in EXTRA_CHECKS.

    PDSERVE_PORT=abc pdserve up
    error: PDSERVE_PORT='abc': expected an integer (the environment form of --port)
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping

PREFIX = "PDSERVE_"
BOOL_WORDS = frozenset({"", "0", "1", "true", "false", "yes", "no", "on", "off"})


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("expected a number") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


def _port(text: str) -> int:
    value = _int(text)
    if not -1 <= value <= 65535:
        raise ValueError("expected a port in 0..65535")
    return value


def _positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise ValueError("expected a number > 0")
    return value


def _size(text: str) -> int:
    from pdserve.shared.engine_args import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise ValueError("expected a size such as 2GiB, 512MiB or 1000000") from None


def _cores(text: str) -> object:
    from pdserve.shared.engine_args import parse_cores

    try:
        return parse_cores(text)
    except ValueError:
        raise ValueError("expected cores such as 0-3 or 0,2,4") from None


def _json_list(text: str) -> list:
    if text.strip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError("expected a JSON list of strings") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("expected a JSON list of strings")
    return []


EXTRA_CHECKS: dict[str, Callable[[str], object]] = {
    "PDSERVE_GRPC_KEEPALIVE_S": _positive_float,
    "PDSERVE_KV_CACHE_MEMORY": _size,
    "PDSERVE_CPU_CORES": _cores,
    "PDSERVE_PREFILL_CPU_CORES": _cores,
    "PDSERVE_DECODE_CPU_CORES": _cores,
    "PDSERVE_ALLOWED_ORIGINS": _json_list,
    "PDSERVE_ALLOWED_METHODS": _json_list,
    "PDSERVE_ALLOWED_HEADERS": _json_list,
}
"""Stricter (or flag-less) checks by variable name; ports are matched by suffix."""


def _walk(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _walk(sub)
        else:
            yield action


def flag_actions(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """PDSERVE_<FLAG> -> the actions of every subcommand with the long flag --<flag>."""
    out: dict[str, list[argparse.Action]] = {}
    for action in _walk(parser):
        for option in action.option_strings:
            if option.startswith("--") and not option.startswith("--no-"):
                name = PREFIX + option[2:].replace("-", "_").upper()
                out.setdefault(name, []).append(action)
    return out


def _check_action(value: str, action: argparse.Action) -> str | None:
    """Why `value` does not fit `action`, or None."""
    flag = action.option_strings[0]
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        if value.strip().lower() not in BOOL_WORDS:
            return f"expected 1/0, true/false, yes/no or on/off (the environment form of {flag})"
        return None
    kind = action.type
    try:
        if kind is int:
            converted: object = _int(value)
        elif kind is float:
            converted = _float(value)
        elif callable(kind) and getattr(kind, "__name__", "") != "_json_list":
            converted = kind(value)
        else:
            converted = value
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        detail = str(e) if str(e).startswith("expected") else f"not a valid {flag} value"
        return f"{detail} (the environment form of {flag})"
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        return f"expected one of {choices} (the environment form of {flag})"
    return None


def check_environment(environ: Mapping[str, str],
                      build_parser: Callable[[], argparse.ArgumentParser]) -> str | None:
    """The first bad PDSERVE_* value as one line (`PDSERVE_X='v': why`), or None.

    `build_parser` is called with every PDSERVE_* variable removed from os.environ (the
    parsers read them as defaults, and a bad one would raise before it could be named).
    """
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(PREFIX)}
    try:
        actions = flag_actions(build_parser())
    finally:
        os.environ.update(saved)
    for name in sorted(k for k in environ if k.startswith(PREFIX)):
        value = environ[name]
        check = EXTRA_CHECKS.get(name) or (_port if name.endswith("_PORT") else None)
        if check is not None:
            try:
                check(value)
            except ValueError as e:
                return f"{name}={value!r}: {e}"
        for action in actions.get(name, ()):
            why = _check_action(value, action)
            if why is not None:
                return f"{name}={value!r}: {why}"
    return None
