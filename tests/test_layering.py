"""The package's floors (docs/extending.md): each package imports only the ones below it, and the
checkpoint loader is the only place that turns a checkpoint into a model."""

import ast
from pathlib import Path

import rwkvx_cli

PACKAGE = Path(rwkvx_cli.__file__).parent

# Each package and the rwkvx_cli packages it must not import (anywhere, lazily included).
FORBIDDEN = {
    "data": {"models", "ops", "runs", "train", "evaluation", "explain", "tools"},
    "ops": {"data", "models", "runs", "train", "evaluation", "explain", "tools"},
    "models": {"data", "runs", "train", "evaluation", "explain", "tools"},
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


def test_only_the_loader_builds_a_model_from_a_checkpoint():
    """A module that builds a model and reads weights into it: runs/opening.py (every command), and
    the trainer's train.init_from at `rwkvx init` (train/runner.py); no fifth copy."""
    builders = []
    for module in sorted(PACKAGE.rglob("*.py")):
        text = module.read_text()
        builds = "LM(" in text or "build_model(" in text
        reads = any(f"{name}(" in text for name in ("load_into", "load_weights", "load_weights_file"))
        if builds and reads:
            builders.append(module.relative_to(PACKAGE).as_posix())
    assert builders == ["runs/opening.py", "train/runner.py"], builders
