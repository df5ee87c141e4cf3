"""The package's floors (docs/extending.md): each package imports only the ones below it, no module
imports one that imports it back (directly or around a loop, lazy imports counted), and the
checkpoint loader is the only place that turns a checkpoint into a model."""

import ast
from pathlib import Path

import rwkvx_cli

PACKAGE = Path(rwkvx_cli.__file__).parent

# Each package and the rwkvx_cli packages it must not import (anywhere, lazily included). From the
# bottom: data, ops; models; formats (other tools' files); checkpoints (rwkvx's own); runs; the rest.
FORBIDDEN = {
    "data": {"models", "ops", "formats", "checkpoints", "runs", "train", "evaluation", "explain", "tools"},
    "ops": {"data", "models", "formats", "checkpoints", "runs", "train", "evaluation", "explain", "tools"},
    "models": {"data", "formats", "checkpoints", "runs", "train", "evaluation", "explain", "tools"},
    "formats": {"checkpoints", "runs", "train", "evaluation", "explain", "tools"},
    "checkpoints": {"data", "runs", "train", "evaluation", "explain", "tools"},
    "runs": {"train", "evaluation", "explain", "tools"},
    "evaluation": {"train", "explain", "tools"},
    "explain": {"train", "evaluation", "tools"},
    "train": {"explain", "tools"},
    "tools": {"train", "evaluation", "explain"},
}


def imported_packages(path: Path) -> set[str]:
    """The rwkvx_cli subpackages a module imports, top-level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "rwkvx_cli" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_each_package_imports_only_the_floors_below_it():
    breaches = []
    for package, forbidden in FORBIDDEN.items():
        for module in sorted((PACKAGE / package).rglob("*.py")):
            bad = imported_packages(module) & forbidden
            if bad:
                breaches.append(f"{module.relative_to(PACKAGE)} imports {sorted(bad)}")
    assert not breaches, breaches


def test_the_scan_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rwkvx_cli.train import loop\n    import rwkvx_cli.tools.bench\n")
    assert imported_packages(module) == {"train", "tools"}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at `root` and the package's modules it imports, at the top or inside a
    function. `from p import n` imports the module p.n when there is one, else p itself (for its name n).
    Importing a module first imports the packages above it, but for the importer's own packages: those
    are being imported already, and none of their names is waited for."""
    modules = {module_name(path, root): path for path in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative to the importer's package
                    base = name.split(".")[: name.count(".") + (path.name == "__init__.py") - node.level + 1]
                    module = ".".join([*base, module] if module else base)
                subs = {f"{module}.{a.name}" for a in node.names}
                targets |= subs & modules.keys()
                if subs - modules.keys():
                    targets.add(module)
        imported = set()
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()  # an attribute of a module, or outside the package
            if parts:
                imported.add(".".join(parts))
                imported |= {".".join(parts[:i]) for i in range(1, len(parts))} - own
        graph[name] = imported - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: each strongly connected component of more than one module, sorted
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_module_imports_one_that_imports_it_back():
    loops = cycles(import_graph(PACKAGE))
    assert not loops, loops


def test_the_cycle_scan_sees_lazy_imports_and_a_package_s_names(tmp_path):
    """A loop closed by a lazy import is found, and so is one through a package's __init__ (a module that
    takes a name from its own package waits for its __init__); a module taking a sibling module from its
    package (`from pkg.a import x`) waits for nothing and closes no loop. Relative imports count too."""
    root = tmp_path / "pkg"
    (root / "a").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("from pkg.a.x import X\nNAME = 1\n")
    (root / "a" / "x.py").write_text("X = 1\ndef f():\n    import pkg.b\n")
    (root / "a" / "y.py").write_text("from pkg.a import x\n")
    (root / "b.py").write_text("from pkg.a import NAME\n")
    (root / "a" / "z.py").write_text("from . import x\nfrom .. import c\n")
    (root / "c.py").write_text("import pkg.a.y\n")
    graph = import_graph(root)
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.a.y"] == {"pkg.a.x"} and graph["pkg.c"] == {"pkg.a", "pkg.a.y"}
    assert graph["pkg.a.z"] == {"pkg.a.x", "pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.a.x", "pkg.b"]]


def test_only_the_loader_builds_a_model_from_a_checkpoint():
    """A module that builds a model and reads weights into it: runs/opening.py (every command, a
    state-tuned run's frozen base too), and
    the trainer's train.init_from at `rwkvx init` (train/runner.py); no fifth copy."""
    builders = []
    for module in sorted(PACKAGE.rglob("*.py")):
        text = module.read_text()
        builds = "LM(" in text or "build_model(" in text
        reads = any(f"{name}(" in text for name in ("load_into", "load_weights", "load_weights_file"))
        if builds and reads:
            builders.append(module.relative_to(PACKAGE).as_posix())
    assert builders == ["runs/opening.py", "train/runner.py"], builders
