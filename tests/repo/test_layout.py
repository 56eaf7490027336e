"""Repository-level checks: our top-level packages are ours, modules stay small."""

from __future__ import annotations

from pathlib import Path

from pdserve.kernels import ops
from pdserve.shared import llm

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400


def test_the_namespace_resolves_inside_the_repository():
    # The editable install maps pdserve.kernels to kernels/, pdserve.shared to shared/.
    assert Path(ops.__file__).resolve().is_relative_to(ROOT / "kernels")
    assert Path(llm.__file__).resolve().is_relative_to(ROOT / "shared")


def test_modules_stay_under_the_size_cap():
    too_big = []
    for top in ("shared", "kernels", "services"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            n = len(path.read_text().splitlines())
            if n > MAX_MODULE_LINES:
                too_big.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not too_big, "modules over the cap (house style §2.7): " + ", ".join(too_big)


def test_generated_proto_stubs_are_current(tmp_path):
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "--proto_path=pdserve=.",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", "pdserve/services/proto/engine.proto"],
                   cwd=ROOT, check=True)
    for name in ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py"):
        fresh = (tmp_path / "pdserve" / "services" / "proto" / name).read_text()
        assert fresh == (ROOT / "services" / "proto" / name).read_text(), (
            f"services/proto/{name} is stale: run `make proto`")
