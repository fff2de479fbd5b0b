"""The runtime imports only downward: no import cycle among moekit's modules, and nothing in the runtime
imports the tools (the `moekit` command, verify, bench, tune). Read from the source, not by importing it."""

import ast
from pathlib import Path

import moekit

ROOT = Path(moekit.__file__).parent
LAYERS = [  # each layer may import those before it (and itself); tools may import everything
    {"moekit._checks", "moekit._triton", "moekit._launch", "moekit._invariant", "moekit._env", "moekit.presets",
     "moekit.layouts"},
    {"moekit.formats"},
    {"moekit.reference"},
    {"moekit.metrics", "moekit.gate", "moekit._calls"},
    {"moekit.routing"},
    {"moekit.experts"},
    {"moekit.layer"},
    {"moekit.distributed", "moekit.integrations"},
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("moekit",) + path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules) -> list[tuple[str, bool]]:
    """(imported moekit module, at module level) for each import in ``path``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            if not base.startswith("moekit"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in modules else base, node.col_offset == 0))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.col_offset == 0) for a in node.names if a.name.startswith("moekit")]
    return found


def _layer(module: str) -> int | None:
    """The module's layer; the package itself (``import moekit``, ``from .. import X``) sits above them all."""
    if module == "moekit":
        return len(LAYERS)
    for i, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return i
    return None


def test_no_import_cycles_and_the_runtime_never_imports_the_tools():
    modules = _modules()
    # function-level imports count too: deferring an import hides a cycle, it does not remove it
    graph = {m: {d for d, _ in _imports(m, p, modules) if d in modules and d != m} for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(modules):
        if m not in state and m not in ("moekit", "moekit.__main__"):  # the package's re-exports and launcher
            visit(m, [])
    runtime = [m for m in modules if not m.startswith("moekit.tools") and m != "moekit.__main__"]
    for m in runtime:
        for d, _ in _imports(m, modules[m], modules):
            assert not d.startswith("moekit.tools"), f"{m} imports {d}: the runtime must not import the tools"


def test_each_layer_imports_only_layers_below_it():
    modules = _modules()
    for m, path in modules.items():
        if m.startswith("moekit.tools") or m in ("moekit", "moekit.__main__"):
            continue
        mine = _layer(m)
        assert mine is not None, f"{m} is in no layer of LAYERS: place it"
        for d, _ in _imports(m, path, modules):
            theirs = _layer(d)
            assert theirs is None or theirs <= mine, f"{m} (layer {mine}) imports {d} (layer {theirs})"
