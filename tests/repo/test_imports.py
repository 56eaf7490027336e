"""The layering: the engine (shared/) and the kernels (kernels/) never import services/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every absolute module name an `import` or `from ... import` in `tree` names."""
    names = []
    for node in ast.walk(tree):  # nested imports too (function-level, lazy)
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_shared_and_kernels_import_nothing_from_services():
    offenders = []
    for top in ("shared", "kernels"):
        for path in (ROOT / top).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in _imported_modules(tree)
                          if name == "pdserve.services" or name.startswith("pdserve.services.")]
    assert not offenders, "shared/ and kernels/ must not import services/: " + \
        ", ".join(offenders)


def test_kernels_import_nothing_from_shared_or_services():
    """The kernels define the attention contract (kernels/attn_metadata.py) that the engine
    fills; they import neither the engine nor the services, not even under TYPE_CHECKING."""
    offenders = []
    for path in (ROOT / "kernels").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        offenders += [f"{path.relative_to(ROOT)}: {name}" for name in _imported_modules(tree)
                      if name.split(".")[:2] in (["pdserve", "shared"], ["pdserve", "services"])]
    assert not offenders, "kernels/ must import neither shared/ nor services/: " + \
        ", ".join(offenders)


def test_service_only_modules_live_under_services():
    """The gRPC messages and the Redis prefix index are the services': no module of the engine
    imports them, and they are not in shared/."""
    assert not (ROOT / "shared" / "proto").exists()
    assert not (ROOT / "shared" / "prefix_index.py").exists()
    assert (ROOT / "services" / "proto" / "engine.proto").is_file()
    assert (ROOT / "services" / "common" / "prefix_index.py").is_file()
