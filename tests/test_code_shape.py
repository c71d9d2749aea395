"""The package keeps the shape a reader can hold in their head: small modules, short functions, floors
that only import downward, no import cycle between any two files (counting imports for typing and inside
functions too), and engine adapters that the core never imports."""

from __future__ import annotations

import ast
import pathlib

import kvconnect

PACKAGE = pathlib.Path(kvconnect.__file__).parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Bottom first. A module may import kvconnect modules of its own floor or of the floors below it; inside
# a floor, the cycle check keeps the files in one order.
LAYERS = [
    {"errors", "metrics", "threads", "progress", "__init__"},
    {"layout"},
    {"wire", "compat"},
    {"runs", "shards", "region_splits"},
    {"regions", "kvgroups"},
    {"descriptors"},
    {"sidechannel"},
    {"transport"},
    {"pd", "offload"},
    {"config", "connector"},
    {"faults", "presets", "cliargs"},
    {"workload", "bench", "demo", "doctor", "proxy"},
    {"cli", "integrations"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def component(path: pathlib.Path) -> str:
    """The first part of a module's dotted name under kvconnect (`pd` for kvconnect/pd/peer.py)."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def dotted(path: pathlib.Path) -> str:
    parts = ("kvconnect", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kvconnect_imports(tree: ast.Module, *, runtime_only: bool) -> list[tuple[int, str]]:
    """(line, module) of every `kvconnect.*` import; `runtime_only` keeps those that run when the module is
    imported (not under `if TYPE_CHECKING:`, not inside a function)."""
    skip: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)) or \
                    isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                skip.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvconnect"):
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("kvconnect")]
    return out


def test_no_module_is_longer_than_the_limit() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_outside_the_benchmarks_is_longer_than_the_limit() -> None:
    long = []
    for path in modules():
        if component(path) == "bench":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_every_module_has_a_layer_and_imports_only_downward() -> None:
    upward = []
    for path in modules():
        mine = component(path)
        assert mine in LAYER, f"{path.relative_to(PACKAGE)} belongs to no layer: add {mine!r} to LAYERS"
        for line, module in kvconnect_imports(ast.parse(path.read_text()), runtime_only=False):
            parts = module.split(".")
            theirs = parts[1] if len(parts) > 1 else "__init__"
            if LAYER.get(theirs, -1) > LAYER[mine]:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not upward, upward


def import_graph(*, runtime_only: bool) -> dict[str, set[str]]:
    """Module -> the kvconnect modules it imports (a package import counts as its `__init__`)."""
    graph: dict[str, set[str]] = {}
    names = {dotted(p) for p in modules()}
    for path in modules():
        deps = set()
        tree = ast.parse(path.read_text())
        imported = {(n.lineno, n.module): [a.name for a in n.names] for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module}
        for line, module in kvconnect_imports(tree, runtime_only=runtime_only):
            # `from kvconnect.pd import consumer` names a module of a package: that module is the dependency.
            subs = [f"{module}.{name}" for name in imported.get((line, module), ())]
            found = [m for m in subs if m in names]
            deps.update(found or [module if module in names else module.rsplit(".", 1)[0]])
        graph[dotted(path)] = deps & names - {dotted(path)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as the modules along it, or None."""
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*trail[trail.index(dep):], dep]
            if dep not in state and (found := visit(dep, [*trail, dep])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_two_files_import_each_other_even_for_typing_or_inside_a_function() -> None:
    graph = import_graph(runtime_only=False)
    # A package's __init__ re-exports its modules; a module importing a sibling through the package is
    # still an import of that sibling, so the re-export edges are left out of the cycle search.
    for name in [n for n in graph if n.count(".") >= 1]:
        graph[name] = {d for d in graph[name] if not name.startswith(d + ".")}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_the_cycle_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_engine_adapters_import_an_engine() -> None:
    offenders = []
    for path in modules():
        if component(path) == "integrations":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, offenders
