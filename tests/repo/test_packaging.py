"""One import namespace: the project installs exactly one top-level package, `pdserve`.

The repository keeps its top-level folders (shared/, kernels/, services/); pyproject's
package-dir maps them to pdserve.shared, pdserve.kernels and pdserve.services. These tests
check the mapping is whole, that nothing imports the bare folder names, that the folders can
never shadow an installed package of the same name, and what a wheel holds. The slow one
installs the wheel into a fresh venv beside transformers and Hugging Face's `kernels` and
runs `pdserve generate` and `pdserve up` there.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("shared", "kernels", "services")
SHIPPED_SUFFIXES = {".py", ".pyi", ".c", ".html", ".js", ".jinja"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _code_folders() -> set[str]:
    """pdserve.<dotted> for every folder under the three tops that holds files to ship."""
    names = set()
    for top in TOPS:
        for folder in [ROOT / top, *(ROOT / top).rglob("*")]:
            if (folder.is_dir() and folder.name != "__pycache__"
                    and any(f.is_file() and f.suffix != ".pyc" for f in folder.iterdir())):
                names.add("pdserve." + ".".join(folder.relative_to(ROOT).parts))
    return names


def test_packages_name_every_folder_and_map_each_top_under_pdserve():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"] == {f"pdserve.{top}": top for top in TOPS}
    assert set(setuptools["packages"]) == _code_folders()
    assert PYPROJECT["project"]["scripts"]["pdserve"] == "pdserve.services.cli:main"


def test_the_top_folders_can_never_shadow_an_installed_package():
    # With no __init__.py, a folder on sys.path (the repository root, under pytest or
    # `python -m`) is at most a namespace portion, and a regular package of the same name
    # anywhere on sys.path wins over it (PEP 420).
    for top in TOPS:
        assert not (ROOT / top / "__init__.py").exists(), f"{top}/__init__.py must not exist"


def test_nothing_imports_the_bare_folder_names():
    offenders = []
    for folder in (*TOPS, "tests", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                              if name.split(".")[0] in TOPS]
    assert not offenders, "import through the namespace (pdserve.<top>): " + ", ".join(offenders)


def test_hugging_face_kernels_is_not_shadowed_from_the_repository_root():
    # transformers >= 5.25 imports Hugging Face's `kernels`; from the repository root (where
    # pytest and `python -m` put the root on sys.path) it must still find that package.
    if importlib.util.find_spec("kernels") is None or not _is_hf_kernels():
        pytest.skip("Hugging Face's kernels is not installed here")
    code = "import kernels, sys; print(kernels.__file__); print(hasattr(kernels, 'get_kernel'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    origin, has_api = done.stdout.split()
    assert not Path(origin).resolve().is_relative_to(ROOT / "kernels") and has_api == "True"


def _is_hf_kernels() -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return bool(version("kernels"))
    except PackageNotFoundError:
        return False


def _build_wheel(out: Path) -> Path:
    """The wheel of a clean copy of what a build reads (setuptools' build/ folder in the
    checkout could carry files deleted since)."""
    source = out / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *TOPS):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns(
            "__pycache__")} if (ROOT / name).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(source)], check=True,
                   capture_output=True, text=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = out.glob("pdserve-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    version = PYPROJECT["project"]["version"]
    assert {name.split("/")[0] for name in names} == {"pdserve", f"pdserve-{version}.dist-info"}
    shipped = {name for name in names if name.startswith("pdserve/")}
    for top in TOPS:  # every code and data file of the three folders, at its namespaced path
        for path in (ROOT / top).rglob("*"):
            if path.suffix in SHIPPED_SUFFIXES and "__pycache__" not in path.parts:
                assert f"pdserve/{path.relative_to(ROOT).as_posix()}" in shipped, path
    assert not any(name.startswith(("pdserve/tests/", "pdserve/benchmarks/")) for name in names)


def _fresh_venv_beside_this_one(venv: Path) -> Path:
    """A new venv whose site-packages links every distribution of this environment but
    pdserve (torch, transformers, Hugging Face's kernels, ...): nothing is downloaded, and
    the wheel is the only pdserve there. Returns the venv's python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                  "get_paths()['purelib'])"], capture_output=True, text=True,
                                 check=True).stdout.strip())
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        lowered = entry.name.lower()
        if lowered.startswith(("pdserve", "__editable__", "_pdserve")) or entry.name == "pip":
            continue
        if not (target / entry.name).exists():
            (target / entry.name).symlink_to(entry)
    return python


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_wheel_installs_and_serves_beside_hugging_face_kernels(wheel, tmp_path, model_path):
    if not _is_hf_kernels():
        pytest.skip("Hugging Face's kernels is not installed here (transformers < 5.25)")
    python = _fresh_venv_beside_this_one(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    pdserve = tmp_path / "venv" / "bin" / "pdserve"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    run = dict(cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)

    probe = subprocess.run([str(python), "-c", (
        "import kernels, pdserve.services.cli as cli, transformers; "
        "print(kernels.__file__, hasattr(kernels, 'get_kernel'), cli.__file__, "
        "transformers.__version__)")], check=True, **run)
    kernels_file, has_api, cli_file, _ = probe.stdout.split()
    assert has_api == "True" and "pdserve" not in kernels_file
    assert str(tmp_path / "venv") in cli_file  # the wheel's copy, not the repository's

    generated = subprocess.run([str(pdserve), "generate", "--model", model_path,
                                "--max-tokens", "16", "--temperature", "0", "--chat",
                                "--prompt", "What is the capital of France?"], **run)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert "Paris" in generated.stdout, generated.stdout

    _chat_through_up(pdserve, model_path, tmp_path, env)


def _chat_through_up(pdserve: Path, model_path: str, tmp_path: Path, env: dict) -> None:
    """`pdserve up` from the wheel's venv: healthy, one greedy chat through the openai
    client, then SIGTERM stops it with exit 0."""
    import openai

    from tests.services.launcher.test_up import _chat, _free_port, _health_ok, _wait_for

    port, log = _free_port(), tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(pdserve), "up", "--model", model_path, "--port", str(port),
                                 "--kv-cache-memory", "128MiB", "--max-model-len", "1024",
                                 "--max-num-seqs", "4"], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(lambda: _health_ok(url + "/health"), proc, log, "gateway /health")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300,
                               max_retries=0)
        answer = _chat(client)
        assert "Paris" in answer, answer
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
