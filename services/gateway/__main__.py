"""`python -m services.gateway`: the OpenAI-compatible HTTP gateway on uvicorn + uvloop.

    python -m services.gateway --port 8000 --prefill-url 127.0.0.1:50051 \\
        --decode-url 127.0.0.1:50052 [--redis-url redis://127.0.0.1:6379] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import sys

from pdserve.services.gateway.config import GatewayConfig, add_cli_args, config_from_cli_args


def loggable(config: GatewayConfig) -> GatewayConfig:
    """`config` as the start-up log shows it: the API key as ***, the admin keys and the
    internal token (repr=False fields) left out."""
    return dataclasses.replace(config, api_key="***" if config.api_key else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_cli_args(parser)


def run(ns: argparse.Namespace) -> int:
    """Start the gateway from parsed flags (also the hook for `pdserve serve gateway`)."""
    import uvicorn

    from pdserve.services.gateway.backpressure import TransportHttpProtocol, set_send_buffer
    from pdserve.services.gateway.multi_model import build_gateway_app, parse_extra_models

    logging.basicConfig(level=str(ns.log_level).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_cli_args(ns)
        extra_models = parse_extra_models(getattr(ns, "extra_model", None) or [], config)
    except (ValueError, FileNotFoundError) as e:  # a bad flag: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("config: %s", loggable(config))
    app = build_gateway_app(config, extra_models)
    loop = "uvloop" if sys.platform != "win32" else "asyncio"
    # NOTE: on SIGTERM uvicorn stops accepting and lets in-flight requests (streams included)
    # finish for up to the grace period (the launcher gives it its --shutdown-timeout - 5 s);
    # then the app itself ends those still running (services/gateway/shutdown.py), so
    # uvicorn's own timeout, a little later, finds nothing left to cancel.
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, loop=loop,
        log_level=str(config.log_level).lower(),
        timeout_graceful_shutdown=config.grace_period + _CANCEL_MARGIN, access_log=False,
        http=TransportHttpProtocol)  # streams see how far behind their client is
    server = _make_server(uv_config, app.state.gateway.shutdown, config.grace_period)
    sock = uv_config.bind_socket()
    set_send_buffer(sock, config.socket_send_buffer)  # backpressure for slow readers
    # Start-up's objects (the tokenizer's, the modules') live as long as the process: out of
    # the collector's generations, so full collections while serving walk only requests'.
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])
    return 0


_CANCEL_MARGIN = 3.0
"""Seconds between the app's cut of the remaining streams and uvicorn's task cancellation."""


def _make_server(config, notice, grace: float):
    """A uvicorn.Server that drains on the first exit signal and exits 0 after an orderly
    shutdown (plain uvicorn re-raises the signal: exit -15).

    First signal: the app's grace period starts and the port stays open, answering new
    requests 503 (`ShutdownNotice.draining`, as vLLM's --shutdown-timeout drain) while the
    requests in flight finish; once none is left (or the grace period and the cut's margin
    have passed) uvicorn stops accepting and exits. A second signal exits at once.
    """
    import uvicorn

    class GatewayServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not started yet: uvicorn just exits
                loop = None
            if loop is None or self.should_exit or notice.draining:
                self.should_exit = True
                self.force_exit = notice.draining  # a second signal: now
                self._captured_signals.clear()  # an orderly stop: no re-raise
                return
            self._captured_signals.clear()
            loop.call_soon_threadsafe(self._drain)

        def _drain(self) -> None:
            notice.begin(grace)
            self._drain_task = asyncio.ensure_future(self._exit_when_drained())

        async def _exit_when_drained(self) -> None:
            await notice.drained(grace, _CANCEL_MARGIN)
            self.should_exit = True

    return GatewayServer(config)


def main(argv: list[str] | None = None) -> int:
    import os

    from pdserve.services.common.env_check import check_environment

    bad_env = check_environment(os.environ, build_parser)
    if bad_env is not None:
        print(f"error: {bad_env}", file=sys.stderr)
        return 2
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
