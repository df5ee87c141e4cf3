"""Every `python -m rwkvx_cli...` entry point, found by looking (each module with `if __name__ == "__main__":`, and
rwkvx_cli/__main__.py, the CLI), run with missing, empty and wrong-kind inputs and refused outputs: one `error:`
line on stderr, a non-zero exit, no traceback, and nothing of the user's touched (the files planted beside and
under the outputs are byte-identical afterwards, and nothing is added). Each case runs in this process through
the tool's own way out (entry.run_main, the CLI's main); one per entry point runs as `python -m` to prove it."""

import ast
import importlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

import rwkvx_cli

PACKAGE = Path(rwkvx_cli.__file__).parent
CLI = "rwkvx_cli"  # rwkvx_cli/__main__.py


def _is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and [type(op) for op in node.test.ops] == [ast.Eq]
        and [getattr(c, "value", None) for c in node.test.comparators] == ["__main__"]
    )


def entry_points() -> dict[str, ast.If | None]:
    """{module: its `if __name__ == "__main__":` block} of every module that has one, and the CLI (None)."""
    found: dict[str, ast.If | None] = {CLI: None}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if _is_main_guard(node):
                found[".".join(("rwkvx_cli", *path.relative_to(PACKAGE).with_suffix("").parts))] = node
    return found


ROW = {"step": 1, "tokens": 1000, "loss": 1.5, "val_bpb": 2.0}
CONFIG = yaml.safe_dump({"model": {"gain": 1.0}}).encode()

# What a user has: inputs of every wrong kind, and files where the tools write (their own scratch names included).
PLANTED = {
    "user.txt": b"mine\n",
    "text.txt": b"one paragraph\n\nanother\n",
    "empty.txt": b"",
    "binary.txt": b"\xff\xfe\x00 not UTF-8\n",
    "wrong.json": b'[{"a": 1}]\n',
    "out.jsonl": b'{"text": "mine"}\n',
    "folder/keep.txt": b"mine\n",
    "work/rows.jsonl": b"mine\n",
    "work/full/a": b"mine\n",
    "work/sharded/a": b"mine\n",
    "work/async/a": b"mine\n",
    "work/bpe.json": b"mine\n",
    "work/out-byte-1/a": b"mine\n",
    "gpuout/gpu.json": b"mine\n",
    "gpuout/gpu.md": b"mine\n",
    "run/config.yaml": CONFIG,
    "run/metrics.jsonl": json.dumps(ROW).encode() + b"\n",
    "badyaml/config.yaml": b"model: [\n",
    "badyaml/metrics.jsonl": json.dumps(ROW).encode() + b"\n",
    "badjson/config.yaml": CONFIG,
    "badjson/metrics.jsonl": b"{\n",
    "binrun/config.yaml": b"\xff\n",
    "binrun/metrics.jsonl": json.dumps(ROW).encode() + b"\n",
}
LINK = ("link.txt", "user.txt")  # a symbolic link to a user's file, where an output goes

# module: [(argv, what the error line says)]
CASES = {
    CLI: [
        (["data", "prepare", "text.txt", "--out", "work"], "already holds files rwkvx did not write"),
        (["data", "prepare", "text.txt", "--out", "user.txt"], "is a file"),
        (["data", "prepare", "missing.txt", "--out", "work"], "not found"),
        (["train", "--config", "missing.yaml"], "No such file"),
        (["train", "--config", "binary.txt"], "not UTF-8"),
        (["train", "--config", "folder"], "Is a directory"),
        (["eval", "--checkpoint", "folder"], "no checkpoint found"),
        (["eval", "--checkpoint", "user.txt"], "no checkpoint found"),
        (["gradcheck", "--op", "wkv4", "--json", "user.txt"], "already exists"),
        (["gradcheck", "--op", "wkv4", "--json", "link.txt"], "already exists"),
        (["nosuchcommand"], "No such command"),
    ],
    "rwkvx_cli.evaluation.reset_ablation": [
        ([], "give the run directories or --from-json"),
        (["run", "--max-len", "0"], "--max-len: must be at least 1"),
        (["run", "--max-len", "x"], "--max-len: 'x' is not a whole number"),
        (["run", "--from-json", "wrong.json"], "one of them"),
        (["--from-json", "missing.json"], "does not exist"),
        (["--from-json", "empty.txt"], "is empty"),
        (["--from-json", "folder"], "is a directory"),
        (["--from-json", "binary.txt"], "not UTF-8"),
        (["--from-json", "text.txt"], "is not JSON"),
        (["--from-json", "wrong.json"], "is not what --json writes"),
        (["--from-json", "wrong.json", "--png", "user.txt"], "--png user.txt already exists"),
        (["--from-json", "wrong.json", "--png", "link.txt"], "--png link.txt already exists"),
        (["--from-json", "wrong.json", "--json", "folder"], "--json folder is a directory"),
        (["--from-json", "wrong.json", "--json", "user.txt/x.json"], "under a file"),
        (["--from-json", "wrong.json", "--json", "x.json", "--png", "x.json"], "the same file"),
    ],
    "rwkvx_cli.tools.bench_sharded": [
        ([], "required: workdir"),
        (["work", "--ranks", "0"], "--ranks: must be at least 1"),
        (["work", "--ranks", "-1"], "--ranks: must be at least 1"),
        (["work", "--saves", "0"], "--saves: must be at least 1"),
        (["work", "--layers", "0"], "--layers: must be at least 1"),
        (["work", "--embd", "100"], "--embd: must be a multiple of 64"),
        (["work", "--vocab", "0"], "--vocab: must be at least 1"),
        (["work", "--formats", "nope"], "invalid choice"),
        (["user.txt"], "WORKDIR user.txt is not a directory"),
        (["user.txt/sub"], "Not a directory"),
    ],
    "rwkvx_cli.tools.bench_convert": [
        ([], "required: workdir"),
        (["user.txt"], "WORKDIR user.txt is not a directory"),
        (["user.txt/sub"], "Not a directory"),
        (["work", "--dtype", "fp8"], "invalid choice"),
    ],
    "rwkvx_cli.tools.bench_prepare": [
        (["--mb", "0"], "--mb: must be greater than 0"),
        (["--mb", "nan"], "--mb: must be greater than 0"),
        (["--repeat", "0"], "--repeat: must be at least 1"),
        (["--workers", "0"], "--workers: must be at least 1"),
        (["--workers", "1,x"], "--workers: 'x' is not a whole number"),
        (["--tokenizers", "nope"], "--tokenizers: 'nope': a comma-separated list"),
        (["--source", "missing.txt"], "--source missing.txt does not exist"),
        (["--source", "empty.txt"], "--source empty.txt is empty"),
        (["--source", "folder"], "--source folder is a directory"),
        (["--source", "binary.txt"], "--source binary.txt is not UTF-8"),
        (["--json", "user.txt"], "--json user.txt already exists"),
        (["--json", "folder"], "--json folder is a directory"),
        (["--dir", "user.txt"], "--dir user.txt is not a directory"),
    ],
    "rwkvx_cli.tools.compare_runs": [
        ([], "required"),
        (["missing", "--by", "model.gain"], "missing is not a run directory"),
        (["user.txt", "--by", "model.gain"], "user.txt is not a run directory"),
        (["run"], "required: --by"),
        (["run", "--by", "model.nope"], "no setting 'model.nope'"),
        (["badyaml", "--by", "model.gain"], "config.yaml is not YAML"),
        (["binrun", "--by", "model.gain"], "config.yaml is not UTF-8"),
        (["badjson", "--by", "model.gain"], "metrics.jsonl is not what `rwkvx train` writes"),
        (["run", "--by", "model.gain", "--png", "user.txt"], "--png user.txt already exists"),
        (["run", "--by", "model.gain", "--png", "folder"], "--png folder is a directory"),
    ],
    "rwkvx_cli.tools.compile_gate": [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["extra"], "unrecognized arguments: extra"),
    ],
    "rwkvx_cli.tools.gpu_check": [
        (["--steps", "nope"], "--steps: 'nope': a comma-separated list"),
        (["--device", "tpu"], "invalid choice"),
        (["--out", "gpuout"], "gpu.json already exists"),
        (["--out", "user.txt"], "is under a file"),
    ],
    "rwkvx_cli.tools.optimizer_ablation": [
        ([], "required: command"),
        (["corpus"], "required: out"),
        (["corpus", "user.txt"], "--out user.txt already exists"),
        (["corpus", "folder"], "--out folder is a directory"),
        (["run", "work", "--size", "nope", "--tokens", "1", "--lrs", "1e-3"], "invalid choice"),
        (["run", "work", "--size", "L4-D128", "--tokens", "0", "--lrs", "1e-3"], "--tokens: must be at least 1"),
        (["run", "work", "--size", "L4-D128", "--tokens", "9", "--lrs", "3"], "--lrs: '3': give numbers between"),
        (["run", "work", "--size", "L4-D128", "--tokens", "9", "--lrs", "1e-3", "--recipes", "sgd"], "not one of"),
        (["run", "work", "--size", "L4-D128", "--tokens", "9", "--lrs", "1e-3"], "files rwkvx did not write"),
        (["keep", "missing", "new"], "missing is not a directory"),
        (["keep", "folder", "new"], "holds no finished ablation run"),
        (["report", "missing"], "missing is not a directory"),
        (["report", "folder", "missing"], "missing is not a directory"),
        (["report", "user.txt"], "user.txt is not a directory"),
        (["report", "work", "--png", "user.txt"], "--png user.txt already exists"),
        (["report", "folder"], "holds no finished ablation run"),
    ],
    "rwkvx_cli.tools.play_chats": [
        ([], "required"),
        (["missing.txt", "--out", "new.jsonl"], "source missing.txt does not exist"),
        (["empty.txt", "--out", "new.jsonl"], "source empty.txt is empty"),
        (["folder", "--out", "new.jsonl"], "source folder is a directory"),
        (["binary.txt", "--out", "new.jsonl"], "source binary.txt is not UTF-8"),
        (["text.txt", "--out", "new.jsonl"], "has no speech of two lines or more"),
        (["text.txt", "--out", "out.jsonl"], "--out out.jsonl already exists"),
        (["text.txt", "--out", "link.txt"], "--out link.txt already exists"),
        (["text.txt", "--out", "user.txt/x.jsonl"], "under a file"),
        (["text.txt", "--out", "new.jsonl", "--turns", "0"], "--turns: must be at least 1"),
    ],
    "rwkvx_cli.tools.short_documents": [
        ([], "required"),
        (["missing.txt", "--out", "new.jsonl"], "source missing.txt does not exist"),
        (["empty.txt", "--out", "new.jsonl"], "source empty.txt is empty"),
        (["folder", "--out", "new.jsonl"], "source folder is a directory"),
        (["binary.txt", "--out", "new.jsonl"], "source binary.txt is not UTF-8"),
        (["text.txt", "--out", "out.jsonl"], "--out out.jsonl already exists"),
        (["text.txt", "--out", "link.txt"], "--out link.txt already exists"),
        (["text.txt", "--out", "folder"], "--out folder is a directory"),
        (["text.txt", "--out", "user.txt/x.jsonl"], "under a file"),
        (["text.txt", "--out", "new.jsonl", "--seed", "x"], "invalid int value"),
    ],
}


def plant(root: Path) -> None:
    for name, data in PLANTED.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    os.symlink(LINK[1], root / LINK[0])


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under `root`, links not followed: a file's bytes, a link's target, a directory."""
    seen: dict[str, object] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                seen[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                seen[rel] = "dir"
            else:
                seen[rel] = path.read_bytes()
    return seen


def run_in_process(module: str, argv: list[str], monkeypatch) -> int:
    """The entry point's way out, in this process: the tool's run_main(main, argv), the CLI's main()."""
    from rwkvx_cli.entry import run_main

    with pytest.raises(SystemExit) as e:
        if module == CLI:
            from rwkvx_cli import cli

            monkeypatch.setattr(sys, "argv", ["rwkvx", *argv])
            monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # given back after main sets its own
            cli.main()
        else:
            run_main(importlib.import_module(module).main, argv)
    return e.value.code


def check_refused(code, stderr: str, fragment: str, what: str) -> None:
    """A non-zero exit and one `error:` line saying `fragment`, last on stderr (warnings may come before it)."""
    assert isinstance(code, int) and code != 0, (what, code, stderr)
    assert "Traceback" not in stderr, (what, stderr)
    lines = stderr.splitlines()
    assert lines and lines[-1].startswith("error: ") and fragment in lines[-1], (what, stderr)
    assert all(line.startswith("warning: ") for line in lines[:-1]), (what, stderr)


def test_every_entry_point_has_cases_and_goes_through_the_shared_way_out():
    """A new `python -m` tool fails here until it has cases below; each tool's `__main__` is run_main(main)."""
    found = entry_points()
    assert set(found) == set(CASES), f"entry points without cases: {sorted(set(found) - set(CASES))}; " + (
        f"cases of no entry point: {sorted(set(CASES) - set(found))}"
    )
    assert "rwkvx_cli.data.pool" not in found  # it only mentions the string
    for module, guard in found.items():
        assert CASES[module], module
        if guard is not None:
            assert [ast.unparse(x) for x in guard.body] == ["run_main(main)"], (module, ast.unparse(guard))


@pytest.mark.parametrize("module", sorted(CASES))
def test_bad_input_is_one_line_and_touches_nothing(module, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    plant(tmp_path)
    before = snapshot(tmp_path)
    for argv, fragment in CASES[module]:
        code = run_in_process(module, argv, monkeypatch)
        captured = capsys.readouterr()
        check_refused(code, captured.err, fragment, [module, *argv])
        assert snapshot(tmp_path) == before, [module, *argv]


def test_each_entry_point_as_python_dash_m(tmp_path):
    """The first case of each entry point in its own `python -m` process (all at once: each imports torch)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    runs = {}
    for module, cases in sorted(CASES.items()):
        argv, fragment = cases[0]
        where = tmp_path / module
        where.mkdir()
        plant(where)
        cmd = [sys.executable, "-m", module, *argv]
        runs[module] = (where, snapshot(where), fragment, subprocess.Popen(
            cmd, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ))
    for module, (where, before, fragment, proc) in runs.items():
        _, stderr = proc.communicate(timeout=300)
        check_refused(proc.returncode, stderr, fragment, module)
        assert snapshot(where) == before, module


def test_ctrl_c_while_a_tool_imports_is_one_line_exit_130(tmp_path):
    """Pressed while `python -m rwkvx_cli.tools.bench_sharded` imports torch: no traceback, nothing made."""
    from tests.test_cli import _interrupted_at_import

    done = _interrupted_at_import(tmp_path, "torch", "-m", "rwkvx_cli.tools.bench_sharded", str(tmp_path / "w"))
    assert (done.returncode, done.stderr, done.stdout) == (130, "interrupted\n", "")
    assert not (tmp_path / "w").exists()


def test_run_main_sorts_errors_as_the_commands_do(capsys):
    from rwkvx_cli.entry import run_main
    from rwkvx_cli.errors import RwkvxError, UsageError

    def raises(e):
        def main(argv):
            raise e

        return main

    for error, code, said in (
        (UsageError("bad flag"), 2, "error: bad flag\n"),
        (RwkvxError("it broke"), 1, "error: it broke\n"),
        (FileNotFoundError(2, "No such file or directory", "x.txt"), 1, "error: x.txt: No such file or directory\n"),
        (MemoryError(), 1, "error: out of memory; make the model, batch or shape smaller\n"),
        (KeyboardInterrupt(), 130, "interrupted\n"),
    ):
        with pytest.raises(SystemExit) as e:
            run_main(raises(error), [])
        assert (e.value.code, capsys.readouterr().err) == (code, said)
    with pytest.raises(SystemExit) as e:
        run_main(lambda argv: 3, [])
    assert e.value.code == 3
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        run_main(lambda argv: 1 / 0, [])
