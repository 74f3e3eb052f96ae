"""The layers stay apart: no import cycles among pdchat's modules, and the chat UI reaches the
engine only through the backend seam (no torch, no engine internals at import)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("engine", "bench", "kernels", "chatapp", "themes")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pdchat", *parts])


def top_level_imports(path: Path) -> set[str]:
    """pdchat modules imported when `path` is imported: module-level statements only (imports
    inside functions and under TYPE_CHECKING run later or never)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.Import, ast.ImportFrom, ast.Try, ast.If)) else ():
            if isinstance(sub, ast.Import):
                found |= {a.name for a in sub.names}
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - sub.level + 1] + ([base] if base else []))
                found.add(base)
                found |= {f"{base}.{a.name}" for a in sub.names}
    return {m for m in found if m.startswith("pdchat.")}


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    return {name: {m for m in top_level_imports(path) if m in modules and m != name}
            for name, path in modules.items()}


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}           # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_the_graph_sees_imports():
    # The check above is only as good as the graph: it must see a known edge of each kind.
    edges = graph()
    assert "pdchat.engine.scheduler" in edges["pdchat.engine.engine"]            # relative import
    assert "pdchat.chatapp.backends.base" in edges["pdchat.chatapp.tui.app"]     # absolute import


def test_the_chat_ui_loads_neither_torch_nor_the_engine():
    code = ("import sys; import pdchat.chatapp.tui.app, pdchat.chatapp.cli; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pdchat.engine.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # The declaration of the settings and the error types are all the UI takes from the engine.
    assert eval(out) == ["pdchat.engine.errors", "pdchat.engine.settings"]
