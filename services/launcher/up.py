"""`pdserve up`: start Redis, the prefill and decode replicas and the gateway, wait until every
health check passes, print the URL and a curl line, and stop them all on Ctrl-C / SIGTERM.

    prereqs (redis-server, model) ─▶ redis ─▶ engines + gateway ─▶ all healthy ─▶ banner
    ─▶ run until a signal or the gateway's death (Redis or a prefill or decode replica that
    dies, before its first ready too, is started again with a backoff and its last log
    lines are quoted, see supervise.py; --no-restart-engines: any death stops everything)
    ─▶ stop stage by stage (SIGTERM to each group, one --shutdown-timeout deadline for all)
    ─▶ SIGKILL what is left ─▶ exit

A second Ctrl-C kills everything at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shlex
import signal
import socket
import sys
import threading
import time

from pdserve.services.launcher.config import UpConfig, config_from_args
from pdserve.services.launcher.cores import (
    available_cores,
    avoid_pinned,
    engine_processes,
    format_cores,
)
from pdserve.services.launcher.health import Prober
from pdserve.services.launcher.memory import check_plan_fits
from pdserve.services.launcher.models import add_models, model_of, resolve_extra_models
from pdserve.services.launcher.plan import ChildSpec, Plan, build_plan, child_env
from pdserve.services.launcher.prereqs import (
    SetupError,
    ensure_model,
    ensure_redis_server,
    served_model_name,
)
from pdserve.services.launcher.process import ChildProcess, LogSink
from pdserve.services.launcher.supervise import RESTARTABLE_ROLES, Backoff, Supervisor
from pdserve.shared.models.architectures import check_model_dir

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL = 0.5
NAME = "pdserve"


class Launcher:
    def __init__(self, plan: Plan, config: UpConfig, sink: LogSink,
                 backoff: Backoff = Backoff()) -> None:
        self.plan = plan
        self.config = config
        self.sink = sink
        env = child_env(os.environ)
        self.children = [(spec, ChildProcess(spec.name, spec.argv, {**env, **spec.env}, sink))
                         for spec in plan.children]
        self.prober = Prober()
        self._stop = threading.Event()
        self._num_signals = 0
        self._signal_name = ""
        self._failed = False
        probes = {child.name: spec.probe for spec, child in self.children}
        # NOTE: one supervisor from the first start on: a replica that dies before it was
        # ever ready is restarted under the same backoff as a later death.
        self.supervisor = Supervisor(
            [(child, spec.ports, spec.name.rsplit("-", 1)[0] in RESTARTABLE_ROLES)
             for spec, child in self.children],
            self.say, restart=config.restart_engines, backoff=backoff,
            busy_ports=lambda ports: [p for p in ports if _port_in_use("127.0.0.1", p)],
            healthy=lambda child: self.prober.check(probes[child.name]), ready=False)

    def say(self, message: str) -> None:
        self.sink.write(NAME, message)

    def _on_signal(self, signum: int, frame) -> None:
        # NOTE: no printing here: the handler may interrupt the main thread inside a write
        # (a held lock, a non-reentrant buffer); _shutdown reports the signal.
        self._num_signals += 1
        self._signal_name = signal.Signals(signum).name
        if self._num_signals > 1:
            for _, child in self.children:
                child.kill()
        self._stop.set()

    @property
    def _force(self) -> bool:
        return self._num_signals > 1

    def run(self) -> int:
        """Returns 0 after a requested stop in which every child exited 0, else 1."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        try:
            if self._start_all():
                self._wait_until_stopped()
        finally:
            clean = self._shutdown()
            self.prober.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0 if clean and not self._failed else 1

    def _start_all(self) -> bool:
        t0 = time.monotonic()
        redis = [(s, c) for s, c in self.children if s.name == "redis"]
        rest = [(s, c) for s, c in self.children if s.name != "redis"]
        for group in (redis, rest):
            for spec, child in group:
                extra = f" on cores {format_cores(spec.cores)}" if spec.cores else ""
                self.say(f"starting {spec.name}{extra}")
                child.start()
            if not self._wait_healthy(group, t0):
                return False
        self._print_banner(time.monotonic() - t0)
        return True

    def _wait_healthy(self, group: list[tuple[ChildSpec, ChildProcess]], t0: float) -> bool:
        pending = list(group)
        deadline = t0 + self.config.startup_timeout
        while pending:
            if self._stop.is_set():
                return False
            engines_pending = any(s.probe.kind == "grpc" for s, _ in pending)
            reason = self.supervisor.tick()  # reaps, restarts a replica when it is due
            if reason is not None:
                self.say(reason)
                self._failed = True
                return False
            for spec, child in list(pending):
                if self.supervisor.is_down(child) or child.poll() is not None:
                    continue  # waits out its backoff (a fatal exit ends the wait above)
                # The gateway's /health needs SERVING engines: ask it only after them.
                if spec.probe.kind == "http" and engines_pending:
                    continue
                if self.prober.check(spec.probe):
                    self.say(f"{spec.name} is ready ({time.monotonic() - t0:.1f} s)")
                    self.supervisor.mark_ready(child)
                    pending.remove((spec, child))
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s, _ in pending)
                self.say(f"{names} not ready after --startup-timeout "
                         f"{self.config.startup_timeout:g} s; stopping everything")
                self._failed = True
                return False
            if pending:
                self._stop.wait(_POLL)
        return True

    def _wait_until_stopped(self) -> None:
        supervisor = self.supervisor
        # NOTE: ticks run here, in the main thread (see supervise.py); a signal during a
        # backoff ends the loop before the child is due, so it is not started again.
        while not self._stop.wait(_POLL):
            reason = supervisor.tick()
            if reason is not None:
                self.say(reason)
                self._failed = True
                return

    def _shutdown(self) -> bool:
        """Stop stage by stage under one deadline; True if every child exited 0."""
        started = [(s, c) for s, c in self.children if c.proc is not None]
        deadline = time.monotonic() + self.config.shutdown_timeout
        if self._signal_name:
            self.say(f"{self._signal_name}: stopping (Ctrl-C again to kill everything now)")
        for stage in sorted({s.stage for s, _ in started}):
            group = [c for s, c in started if s.stage == stage]
            for child in group:
                child.terminate()
            for child in group:
                while child.running and time.monotonic() < deadline and not self._force:
                    child.wait(0.2)
        if self._force:
            self.say("a second signal: killed everything")
        codes = {}
        for spec, child in started:
            if child.running:
                if not self._force:
                    self.say(f"{spec.name} still running after --shutdown-timeout "
                             f"{self.config.shutdown_timeout:g} s: SIGKILL")
                child.kill()
            codes[spec.name] = child.wait(10)
            child.kill()  # anything its leader left behind in the group
            child.join_output()
        if started:
            self.say("stopped: " + ", ".join(f"{n} {_describe(c)}" for n, c in codes.items()))
        # NOTE: uvicorn re-raises the SIGTERM it handled once it has shut down cleanly.
        return all(c in (0, -signal.SIGTERM) for c in codes.values())

    def _print_banner(self, elapsed: float) -> None:
        url = self.plan.gateway_url
        rows = [f"pdserve is ready in {elapsed:.0f} s: {url}/v1 serves "
                f"{self.plan.served_model_name}"]
        width = max(len(s.name) for s, _ in self.children)
        for spec, _ in self.children:
            if spec.probe.kind == "redis":
                what = self.plan.redis_url
            elif spec.probe.kind == "grpc":
                what = (f"grpc {spec.probe.target}  metrics "
                        f"http://127.0.0.1:{spec.ports[1]}/metrics")
                if spec.cores:
                    what += f"  cores {format_cores(spec.cores)}"
                if self.config.extra_models:
                    what += f"  model {model_of(spec)}"
            else:
                what = f"{url}  metrics {url}/metrics"
            rows.append(f"  {spec.name.ljust(width)}  {what}")
        rows += ["Try it:", "  " + curl_line(url, self.plan.served_model_name,
                                             self.config.api_key),
                 "Stop with Ctrl-C."]
        self.sink.raw("\n".join(rows))


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"ended by {signal.Signals(-code).name}"
    return f"exit {code}"


def curl_line(url: str, model: str, api_key: str | None) -> str:
    body = json.dumps({"model": model, "max_tokens": 64, "messages": [
        {"role": "user", "content": "Why is the sky blue?"}]})
    # NOTE: the key itself never goes to the output (logs keep it): the line reads it from
    # the environment of whoever pastes it.
    auth = ' -H "Authorization: Bearer $PDSERVE_API_KEY"' if api_key else ""
    return (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(body)}")


def with_internal_token(config: UpConfig) -> UpConfig:
    """`config` with a random internal token (256 bits, never printed) unless it has one:
    each launch's services accept only their own launcher's children."""
    if config.internal_token:
        return config
    return dataclasses.replace(config, internal_token=secrets.token_urlsafe(32))


def _port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError:
            return True
    return False


def _claim_cores(config: UpConfig, say) -> UpConfig:
    """Keep off the cores other pdserve engines of this machine are pinned to.

    Cores chosen with --cpu-cores / --prefill-cpu-cores / --decode-cpu-cores are used as
    given (one line says whose they are); otherwise the launcher takes the cores nobody
    pinned, and refuses (SetupError, one line) when none are left.
    """
    engines = engine_processes(exclude=(os.getpid(),))
    machine = set(range(os.cpu_count() or 1))
    others = [e for e in engines if set(e.cores) < machine]
    if not others:
        if engines and config.cpu_share:
            say(f"{len(engines)} engines of another pdserve run on every core here (pids "
                f"{', '.join(str(e.pid) for e in engines)}); the core board shares the cores "
                "between them and these")
        return config
    explicit = [c for cores in (config.cpu_cores, config.prefill_cpu_cores,
                                config.decode_cpu_cores) for c in cores or ()]
    if explicit:
        _, reason = avoid_pinned(sorted(set(explicit)), others)
        if reason:
            say(f"warning: {reason}; using them as --cpu-cores asks")
        return config
    wanted = available_cores()
    free, reason = avoid_pinned(wanted, others)
    if reason is None:
        return config
    if not free:
        raise SetupError(f"{reason}, and this machine has no other core for this one "
                         f"(stop that pdserve, or pass --cpu-cores to share them knowingly)")
    say(f"{reason}; using cores {format_cores(free)}")
    return dataclasses.replace(config, cpu_cores=free)


def main(ns: argparse.Namespace) -> int:
    sink = LogSink(sys.stdout, width=len(NAME))
    try:
        config = config_from_args(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def say(message: str) -> None:
        sink.write(NAME, message)

    try:  # a missing prerequisite: exit 1; a bad flag or model: exit 2
        config = _claim_cores(with_internal_token(config), say)
        # A model pdserve does not serve (a .gguf's too, from its header): before converting.
        check_model_dir(config.engine_args.model, config.engine_args.max_model_len)
        if config.redis_url is None:
            ensure_redis_server(say)
        model_path = ensure_model(config.engine_args.model, say)
        # The engines' own check, now: a bad flag (or model) fails before anything starts.
        dataclasses.replace(config.engine_args, model=model_path).create_engine_configs()
        name = served_model_name(config.engine_args.model, model_path,
                                 config.engine_args.served_model_name)
        plan = build_plan(config, model_path, name)
        if config.extra_models:  # more models behind the one gateway (launcher/models.py)
            plan = add_models(plan, config, resolve_extra_models(config, say))
    except SetupError as e:
        say(f"error: {e}")
        return 1
    except (ValueError, FileNotFoundError) as e:
        say(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        say("interrupted before anything started")
        return 130
    try:  # a plan that cannot fit the machine: refused now, not OOM-killed under load
        too_big = check_plan_fits(plan)
    except (OSError, ValueError) as e:
        too_big = None
        say(f"warning: could not estimate the plan's memory ({e})")
    if too_big:
        say(f"error: {too_big}")
        return 2
    busy = [f"{spec.name} port {port}" for spec in plan.children for port in spec.ports
            if _port_in_use(config.host if spec.name == "gateway" else "127.0.0.1", port)]
    if busy:
        say("error: in use already: " + ", ".join(busy) + " (pick others with --port, "
            "--prefill-port, ... or leave the internal ones unset)")
        return 1
    sink.width = max(len(NAME), *(len(s.name) for s in plan.children))
    return Launcher(plan, config, sink).run()
