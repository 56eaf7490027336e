"""What `pdserve up` needs before it starts anything: a redis-server binary and the model
converted to a local directory (both done once, in the foreground, with their own output)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable

from pdserve.shared.models.convert import DEFAULT_MODEL, resolve_model_path

INSTALL_REDIS = ["apt-get", "install", "-y", "-q", "redis-server"]


class SetupError(RuntimeError):
    """A prerequisite is missing and cannot be fixed here; the message says what to run."""


def ensure_redis_server(say: Callable[[str], None]) -> str:
    """The path of `redis-server`; installs Debian's package when root and apt-get exists.

    Raises:
        SetupError: not installed and not installable from here (the message has the
            exact command to run).
    """
    path = shutil.which("redis-server")
    if path:
        return path
    if shutil.which("apt-get") is None:
        raise SetupError("redis-server is not installed: install Redis >= 6 with your "
                         "package manager (e.g. `brew install redis`), or pass --redis-url")
    if os.geteuid() != 0:
        raise SetupError("redis-server is not installed; run:\n"
                         "    sudo apt-get update && sudo apt-get install -y redis-server\n"
                         "or pass --redis-url redis://HOST:PORT/0")
    say("redis-server is missing: " + " ".join(INSTALL_REDIS))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(INSTALL_REDIS, env=env).returncode != 0:
        say("retrying after apt-get update")
        subprocess.run(["apt-get", "update", "-q"], env=env, check=False)
        subprocess.run(INSTALL_REDIS, env=env, check=False)
    path = shutil.which("redis-server")
    if not path:
        raise SetupError("installing redis-server failed (see apt-get's output above)")
    return path


def ensure_model(model: str, say: Callable[[str], None]) -> str:
    """The local HF directory of `model`, converting the default model or a .gguf once.

    The conversion runs in a child process (`pdserve convert`, with its progress bar), so
    this launcher never imports torch or transformers.

    Raises:
        SetupError: the model is neither a directory, a .gguf file nor the default name, or
            the conversion failed.
    """
    try:
        return str(resolve_model_path(model, convert=False))
    except FileNotFoundError as e:
        if model != DEFAULT_MODEL and not model.endswith(".gguf"):
            raise SetupError(str(e)) from None
        if model.endswith(".gguf") and not os.path.isfile(model):
            raise SetupError(f"model {model!r}: no such file") from None
    say(f"converting {model} once (pdserve convert)")
    cmd = [sys.executable, "-m", "pdserve.services.cli", "convert", "--model", model]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL,
                          env={**os.environ, "HF_HUB_OFFLINE": os.environ.get(
                              "HF_HUB_OFFLINE", "1")})
    if done.returncode != 0:
        raise SetupError(f"converting {model} failed (exit {done.returncode}); see above")
    try:
        return str(resolve_model_path(model, convert=False))
    except FileNotFoundError as e:
        raise SetupError(str(e)) from None


def served_model_name(model: str, model_path: str, served_name: str | None) -> str:
    """The name clients use, derived as the engine and the gateway derive it."""
    if served_name:
        return served_name
    return model if os.sep not in model else os.path.basename(model_path.rstrip(os.sep))
