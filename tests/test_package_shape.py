"""The package's shape, read from its source with ast (no process; one test imports each package to check its exports).

The rules:
  * no import circle anywhere in lowband/: no module imports, at any depth (module level or
    inside a function), a module that imports it back. A package's __init__ counts as that
    package's module; `from lowband.x import y` where y is a submodule imports lowband.x.y,
    where y is a name defined in lowband.x it imports lowband.x; a module named in a string where
    importlib.import_module is called (lowband/cli.py's command table) counts as imported too.
  * no module over MAX_LINES lines.
  * the layers of docs/architecture.md: a package imports only packages below it (the block there is
    read, so the picture and the code cannot drift apart), and it names every package;
  * at most MAX_TOP modules at the top of lowband/;
  * the core knows nothing of fault tolerance or test faults: the trainer asks its membership
    (lowband.ft.session) and never whether fault tolerance is on; the optimizers never import testing/.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "lowband"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"
MAX_LINES = 700
MAX_TOP = 5


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under lowband/."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a module of the package."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def _imports(mod: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every lowband module `mod` imports, at any depth of its source."""
    is_pkg = path.name == "__init__.py"
    pkg = mod if is_pkg else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    target = _resolve(alias.name, modules)
                    if target:
                        found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            if not (base_name == PACKAGE or base_name.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                target = sub if sub in modules else _resolve(base_name, modules)
                if target:
                    found.add(target)
    # Imports by name (importlib.import_module(NAME), NAME from a table such as lowband/cli.py's): in a
    # module that calls import_module, every string that names a module of the package is an import.
    if any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree)):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules \
                    and node.value != PACKAGE:  # "lowband" alone is a program name (prog=), not an import
                found.add(node.value)
    found.discard(mod)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {mod: _imports(mod, path, modules) for mod, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)

    cycles = []
    for comp in comps:
        members = set(comp)
        start = comp[0]
        # Shortest path back to start inside the component (BFS).
        prev: dict[str, str] = {}
        frontier = [start]
        seen = {start}
        path = None
        while frontier and path is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        path = [start]
                        u = v
                        while u != start:
                            path.append(u)
                            u = prev[u]
                        path = [start, *reversed(path[1:]), start]
                        break
                    if w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if path:
                    break
            frontier = nxt
        cycles.append({"modules": comp, "cycle": path})
    return cycles


def test_the_graph_sees_function_level_and_named_imports():
    graph = import_graph()
    assert "lowband.commands.bench" in graph["lowband.cli"]  # importlib.import_module of the command table
    assert "lowband.report.render" in graph["lowband.commands.bench"]
    assert "lowband.train.jobfile" in graph["lowband.bench.jobs"]  # inside run_command()


def test_no_import_circle():
    cycles = find_cycles(import_graph())
    msg = "\n".join(
        f"circle among {c['modules']}: {' -> '.join(c['cycle'])}" for c in cycles
    )
    assert not cycles, "import circles in lowband/:\n" + msg


def test_no_module_over_max_lines():
    over = {
        str(path.relative_to(ROOT.parent)): n
        for path in sorted(ROOT.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_a_circle_is_found_and_printed_as_a_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    (cycle,) = find_cycles(graph)
    assert cycle["modules"] == ["a", "b", "c"] and cycle["cycle"] == ["a", "b", "c", "a"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def layers() -> dict[str, int]:
    """docs/architecture.md's layer block: package or top-level module (``cli``, ``units``) -> its height."""
    text = ARCHITECTURE.read_text()
    start = text.index("<!-- layers:")
    block = text[text.index("```text\n", start) + len("```text\n"):text.index("```", text.index("```text\n", start) + 8)]
    out: dict[str, int] = {}
    rows = [line.split() for line in block.splitlines()[2:] if line[:6].strip()]
    for height, (_, name, *_rest) in enumerate(reversed(rows)):
        out[name.rstrip("/").removesuffix(".py")] = height
    return out


def _unit(module: str) -> str:
    """The layer unit of a module: its package under lowband/ (``lowband.optim.outer.diloco`` -> ``optim``), or
    the top-level module's own name; ``lowband`` itself (the public API) and ``__main__`` stand above all."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lowband"


def test_the_architecture_picture_names_every_package_and_top_module():
    names = set(layers())
    on_disk = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    on_disk |= {p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert on_disk == names, f"docs/architecture.md's layers lack {on_disk - names}, name gone {names - on_disk}"


def test_every_import_goes_down_the_layers():
    height = layers()
    top = max(height.values()) + 1
    height.update({"lowband": top, "__main__": top})
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in import_graph().items()
        for b in targets
        if _unit(a) != _unit(b) and height[_unit(a)] <= height[_unit(b)]
    )
    assert not upward, "imports that go up or across docs/architecture.md's layers:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import():
    height = {"optim": 5, "testing": 8}
    assert height[_unit("lowband.optim.outer.diloco")] <= height[_unit("lowband.testing.poison")]
    assert _unit("lowband.cli") == "cli" and _unit("lowband") == "lowband"
    assert layers()["compress"] < layers()["optim"] < layers()["train"] < layers()["commands"] < layers()["cli"]


def test_at_most_five_modules_at_the_top():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP, f"{len(top)} modules at the top of lowband/ (at most {MAX_TOP}): {top}"


def test_the_core_knows_nothing_of_fault_tolerance_or_test_faults():
    graph = import_graph()
    ft_in_core = sorted(m for m in graph["lowband.train.loop"] if m.startswith("lowband.ft") and m != "lowband.ft.session")
    assert not ft_in_core, f"the trainer imports fault tolerance beyond its membership interface: {ft_in_core}"
    loop = (ROOT / "train" / "loop.py").read_text()
    assert "self.ft" not in loop and "ft_cfg" not in loop, "the trainer asks whether fault tolerance is on"
    poisoned = sorted(f"{a} -> {b}" for a, bs in graph.items() if a.startswith("lowband.optim")
                      for b in bs if b.startswith("lowband.testing"))
    assert not poisoned, f"optimizers importing test faults: {poisoned}"


def test_every_package_exports_names_that_exist():
    """Each package's ``__init__`` only exports, and each name it exports is there (lazy ones are looked up)."""
    import importlib

    missing = []
    for init in sorted(ROOT.rglob("__init__.py")):
        name = ".".join(init.relative_to(ROOT.parent).parent.parts)
        pkg = importlib.import_module(name)
        missing += [f"{name}.{n}" for n in getattr(pkg, "__all__", ()) if not hasattr(pkg, n)]
    assert not missing, f"exported but not defined: {missing}"


def test_imports_are_at_the_top_unless_a_reason_is_written_beside_them():
    """An import inside a function hides what a module depends on: it is allowed with its reason (an optional
    dependency, a heavy import a command must not pay for) on its line or the line above."""
    hidden = []
    for path in sorted(ROOT.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import | ast.ImportFrom):
                    here, above = lines[sub.lineno - 1], lines[sub.lineno - 2].strip()
                    if "#" not in here and not above.startswith("#"):
                        hidden.append(f"{path.relative_to(ROOT.parent)}:{sub.lineno}: {here.strip()}")
    assert not hidden, "imports inside functions without a reason beside them:\n" + "\n".join(sorted(set(hidden)))
