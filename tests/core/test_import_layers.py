"""Imports inside the ebbtide package point one way, down the layers: the components (memory, comm, quant, optim)
import no layer above them; sync and compat sit on the components and import no integration; the adapters to
other projects (integrations) import no tool (bench, the colocation harness, anchors, test support, the CLI).

The graph is test_import_cycles.py's (every import at module level or inside a function). A module's layer is that
of the top-level name under ``ebbtide`` it belongs to; private top-level modules (``_native``, ``_messages``, ...)
are the base, and a public name not listed here counts as a tool (it may import anything, nothing below imports it).
"""
from __future__ import annotations

from test_import_cycles import PACKAGE_DIR, import_graph

LAYERS = (  # bottom up: a module imports modules of its own layer or of a layer below
    ("base", {"", "errors", "settings"}),
    ("components", {"memory", "comm", "quant", "optim"}),
    ("sync and compat", {"sync", "compat"}),
    ("integrations", {"integrations"}),
)
TOOLS = len(LAYERS)  # bench, colocate, anchors, testing, cli, info, __main__, and names not listed


def layer_of(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else ""
    if name.startswith("_") and name != "__main__":
        return 0
    return next((i for i, (_, names) in enumerate(LAYERS) if name in names), TOOLS)


def upward_edges(graph: dict) -> list[str]:
    """Every import of a module in a higher layer than the importer's, as "a -> b (layer -> layer)"."""
    label = [n for n, _ in LAYERS] + ["tools"]
    return [f"{a} -> {b} ({label[layer_of(a)]} -> {label[layer_of(b)]})" for a in sorted(graph)
            for b in sorted(graph[a]) if layer_of(b) > layer_of(a)]


def test_imports_point_down_the_layers():
    graph = import_graph(PACKAGE_DIR)
    assert {"ebbtide.optim.sharded", "ebbtide.integrations.sglang.loader",
            "ebbtide.integrations.megatron.hybrid_device"} <= set(graph)
    bad = upward_edges(graph)
    assert not bad, "imports against the layers:\n" + "\n".join("  " + e for e in bad)


def test_the_check_finds_an_upward_import():
    graph = {"ebbtide.optim.sharded": {"ebbtide.integrations.megatron._sharded", "ebbtide.errors"},
             "ebbtide.sync.plan": {"ebbtide.integrations.sglang.forms"},
             "ebbtide.integrations.sglang.forms": {"ebbtide.sync.plan", "ebbtide.bench.suites.sync"},
             "ebbtide._native": {"ebbtide.errors"}, "ebbtide.bench.suites.sync": {"ebbtide.integrations.sglang"}}
    assert upward_edges(graph) == [
        "ebbtide.integrations.sglang.forms -> ebbtide.bench.suites.sync (integrations -> tools)",
        "ebbtide.optim.sharded -> ebbtide.integrations.megatron._sharded (components -> integrations)",
        "ebbtide.sync.plan -> ebbtide.integrations.sglang.forms (sync and compat -> integrations)"]
