"""Registers `pdserve up` (hooked by shared.cli); the work happens in services.launcher.up."""

from __future__ import annotations

import argparse


def add_up_command(sub) -> None:
    from services.launcher.config import add_up_args

    p = sub.add_parser(
        "up", help="run Redis, prefill, decode and the gateway locally until Ctrl-C",
        description="Start Redis, the prefill and decode services and the OpenAI-compatible "
                    "gateway as child processes, wait for their health checks, print the "
                    "URL; Ctrl-C or SIGTERM drains and stops them all.")
    add_up_args(p)
    p.set_defaults(func=_cmd_up)


def _cmd_up(ns: argparse.Namespace) -> int:
    from services.launcher.up import main

    return main(ns)
