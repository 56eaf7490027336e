"""`python -m services.gateway`: the OpenAI-compatible HTTP gateway on uvicorn + uvloop.

    python -m services.gateway --port 8000 --prefill-url 127.0.0.1:50051 \\
        --decode-url 127.0.0.1:50052 [--redis-url redis://127.0.0.1:6379] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from services.gateway.config import add_cli_args, config_from_cli_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_cli_args(parser)


def run(ns: argparse.Namespace) -> int:
    """Start the gateway from parsed flags (also the hook for `pdserve serve gateway`)."""
    import uvicorn

    from services.gateway.app import build_app

    logging.basicConfig(level=str(ns.log_level).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_cli_args(ns)
    except (ValueError, FileNotFoundError) as e:  # a bad flag: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    shown = dataclasses.replace(config, api_key="***" if config.api_key else None)
    logging.getLogger(__name__).info("config: %s", shown)
    app = build_app(config)
    loop = "uvloop" if sys.platform != "win32" else "asyncio"
    # NOTE: on SIGTERM uvicorn stops accepting and lets in-flight requests (streams included)
    # finish for up to the grace period; the launcher gives it its --shutdown-timeout - 5 s.
    uvicorn.run(app, host=config.host, port=config.port, loop=loop,
                log_level=str(config.log_level).lower(),
                timeout_graceful_shutdown=max(1, round(config.grace_period)),
                access_log=False)  # our access lines carry the request id
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
