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
