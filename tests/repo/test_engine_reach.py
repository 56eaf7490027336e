"""Services read the engine through its public views, never its containers (issue 33): no
module under services/ touches a scheduler container, the KV cache manager's per-request
table or a private attribute of an engine object. The state feed and the leak audit use
`Scheduler.request_views()` / `block_holders()` instead."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCHEDULER_CONTAINERS = frozenset({
    "requests", "waiting", "running", "paused", "kv_transfers",
    "finished_sending", "waiting_for_remote_kvs", "aborted_recving",
})
"""Attributes of a `Scheduler` (and of its collaborators) a service must not read."""
ENGINE_INTERNALS = frozenset({
    "kv_transfers", "finished_sending", "waiting_for_remote_kvs", "aborted_recving",
    "req_to_blocks",
})
"""Names only the engine's bookkeeping uses: forbidden on any object in services/."""
ENGINE_OBJECTS = frozenset({
    "engine", "engine_core", "core", "e", "scheduler", "kv_cache_manager", "block_pool",
    "model_runner", "kv_connector",
})
"""Names that hold engine objects in services/: none of their `_`-prefixed attributes."""


def _tail(node: ast.expr) -> str | None:
    """The last name of `a.b.c` (c) or of a bare name."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def reaches(source: str) -> list[str]:
    """`line: expression` of every forbidden access in `source`."""
    tree = ast.parse(source)
    schedulers = {"scheduler"}  # names bound to a scheduler (`s = engine.scheduler`)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _tail(node.value) == "scheduler":
            schedulers.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        receiver = _tail(node.value)
        on_scheduler = receiver in schedulers or (
            isinstance(node.value, ast.Attribute) and node.value.attr == "scheduler")
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if (on_scheduler and (node.attr in SCHEDULER_CONTAINERS or private)) \
                or node.attr in ENGINE_INTERNALS \
                or (private and receiver in ENGINE_OBJECTS):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checker_flags_each_kind_of_reach():
    source = """
def op(engine, kv):
    scheduler = engine.scheduler
    a = scheduler.running, engine.scheduler.requests, scheduler.paused
    b = kv.req_to_blocks, scheduler._finished_req_ids, engine._stopped
    c = scheduler.request_views(), scheduler.block_holders(), request.paused, self._x
"""
    assert [r.split(": ")[1] for r in reaches(source)] == [
        "scheduler.running", "engine.scheduler.requests", "scheduler.paused",
        "kv.req_to_blocks", "scheduler._finished_req_ids", "engine._stopped"]


def test_no_service_module_reaches_into_the_engine():
    found = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        found += [f"{path.relative_to(ROOT)}:{r}" for r in reaches(path.read_text())]
    assert not found, "services read engine internals (use Scheduler.request_views() / " \
        "block_holders() or a public method): " + ", ".join(found)
