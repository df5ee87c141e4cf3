"""The command line through Typer's runner: exit codes, output, JSON."""

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli import __version__
from rwkvx_cli.cli import app
from rwkvx_cli.ops import get_op, op_names, registry
from rwkvx_cli.ops.registry import Backend, Case, OpSpec
from rwkvx_cli.tools.gradcheck import plan_gradcheck

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args))


def test_version_and_help():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"rwkvx {__version__}"
    result = invoke("--help")
    assert result.exit_code == 0 and "gradcheck" in result.stdout


def test_help_keeps_the_brackets_of_an_install_hint():
    """rich markup would eat `[eval]` out of `pip install 'rwkvx[eval]'`."""
    for args in (["--help"], ["eval", "--help"]):
        result = invoke(*args)
        assert result.exit_code == 0 and "pip install 'rwkvx[eval]'" in " ".join(result.stdout.split()), args


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval"], "Missing option '--checkpoint'"),
        (["bench", "--steps", "x"], "Invalid value for '--steps'"),
        (["bench", "--device", "tpu"], "'--device': 'tpu' is not one of 'auto', 'cpu', 'cuda'"),
        (["export", "--checkpoint", "x", "--out", "y", "--dtype", "int4"], "'int4' is not one of"),
        (["train", "--no-such-flag"], "No such option: --no-such-flag"),
    ],
)
def test_parse_errors_are_one_line_exit_2(args, message):
    """Typer's own errors (before a command runs) look like every other error: one line, exit 2."""
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "--help" in lines[0] and "Traceback" not in result.output


def test_gradcheck_wkv7_passes_and_writes_json(tmp_path):
    """The command's wiring and JSON, on two backends (a native kernel and a torch one): each production
    backend's numbers are tools/test_gradcheck.py's; the Triton ones under the interpreter took most of a minute."""
    path = tmp_path / "out" / "gc.json"
    result = invoke("gradcheck", "--op", "wkv7", "--backend", "cpu", "--backend", "recurrent", "--json", str(path))
    assert result.exit_code == 0, result.output
    assert "PASS wkv7" in result.stdout and "recurrent" in result.stdout
    data = json.loads(path.read_text())
    assert data["op"] == "wkv7" and data["passed"] is True and data["seconds"] > 0
    gates = [(r["gate"], r["case"]) for r in data["results"]]
    assert ("B", "finite_diff") in gates and ("A", "ragged_T") in gates
    assert {r["backend"] for r in data["results"]} == {"cpu", "recurrent"}
    for r in data["results"]:
        for c in r["columns"]:
            assert c["max_rel"] < 1e-3 and not c["vacuous"], (r["case"], c)


def test_gradcheck_without_backend_checks_every_production_backend():
    ((spec, backends),) = plan_gradcheck("wkv7", None, 1)
    assert [bk.name for bk in backends] == [bk.name for bk in get_op("wkv7").production_backends()]


def test_unknown_op_is_a_usage_error():
    result = invoke("gradcheck", "--op", "wkv99")
    assert result.exit_code == 2
    assert "unknown op 'wkv99'" in result.stderr and f"valid ops: {', '.join(op_names())}" in result.stderr
    assert "Traceback" not in result.output


def test_unknown_backend_is_a_usage_error():
    result = invoke("gradcheck", "--op", "wkv7", "--backend", "cuda_magic")
    assert result.exit_code == 2 and f"valid: auto, {', '.join(get_op('wkv7').backends)}" in result.stderr


def test_bad_size_is_a_usage_error():
    assert invoke("gradcheck", "--op", "wkv7", "--size", "0").exit_code == 2


def _scan_reference(x, w, state):
    """Toy op: s_t = exp(w_t) s_{t-1} + x_t, y_t = s_t (per channel)."""
    ys = []
    for t in range(x.shape[1]):
        state = torch.exp(w[:, t]) * state + x[:, t]
        ys.append(state)
    return torch.stack(ys, 1), state


def _scan_cumsum(x, w, state):
    """A second, independent formulation: prefix sums in log space."""
    c = torch.cumsum(w, 1)
    y = torch.exp(c) * (state[:, None] + torch.cumsum(x * torch.exp(-c), 1))
    return y, y[:, -1]


def _toy_spec(production_fn):
    def sample(case, gen):
        B, T, H, N = (case.dims[d] for d in "BTHN")
        return {
            "x": torch.rand(B, T, H, N, generator=gen, dtype=torch.float64) - 0.5,
            "w": -0.5 * torch.rand(B, T, H, N, generator=gen, dtype=torch.float64),
            "state": torch.rand(B, H, N, generator=gen, dtype=torch.float64) - 0.5,
        }

    def public(x, w, state=None, *, backend="auto"):
        raise AssertionError("gradcheck must call backends, not the public function")

    return OpSpec(
        name="toyscan",
        summary="test-only decayed prefix sum",
        fn=public,
        inputs=("x", "w"),
        states=("state",),
        sample=sample,
        cases=(Case("small", {"B": 2, "T": 5, "H": 1, "N": 3}, True),),
        fd_case=Case("fd", {"B": 1, "T": 4, "H": 1, "N": 2}, True),
        backends={
            "cumsum": Backend("cumsum", production_fn, "prefix sums"),
            "reference": Backend("reference", _scan_reference, "loop", production=False),
        },
    )


@pytest.fixture
def toy_registered(monkeypatch):
    def install(production_fn):
        monkeypatch.setitem(registry._OPS, "toyscan", _toy_spec(production_fn))

    return install


def test_a_new_op_needs_no_change_to_gradcheck(toy_registered):
    toy_registered(_scan_cumsum)
    result = invoke("gradcheck", "--op", "toyscan")
    assert result.exit_code == 0, result.output
    assert "PASS toyscan" in result.stdout and "cumsum" in result.stdout


def test_failing_backend_exits_1(toy_registered):
    def wrong(x, w, state):
        y, s = _scan_cumsum(x, w, state)
        return y * 1.01, s

    toy_registered(wrong)
    result = invoke("gradcheck", "--op", "toyscan")
    assert result.exit_code == 1
    assert "FAIL toyscan" in result.stdout and "Traceback" not in result.output


def test_gradcheck_all_checks_every_registered_op(monkeypatch, tmp_path):
    def wrong(x, w, state):
        y, s = _scan_cumsum(x, w, state)
        return y * 1.01, s

    good, bad = _toy_spec(_scan_cumsum), dataclasses.replace(_toy_spec(wrong), name="toybad")
    monkeypatch.setattr(registry, "_OPS", {"toyscan": good})
    result = invoke("gradcheck", "--op", "all")
    assert result.exit_code == 0, result.output
    assert "PASS toyscan" in result.stdout and "PASS all: 1 of 1 ops passed" in result.stdout

    monkeypatch.setitem(registry._OPS, "toybad", bad)
    path = tmp_path / "all.json"
    result = invoke("gradcheck", "--op", "all", "--json", str(path))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "FAIL toybad" in result.stdout and "PASS toyscan" in result.stdout  # one report per op
    assert "FAIL all: 1 of 2 ops passed" in result.stdout and "failed: toybad" in result.stdout
    data = json.loads(path.read_text())
    assert data["passed"] is False and [r["op"] for r in data["ops"]] == ["toybad", "toyscan"]


def test_gradcheck_all_with_a_backend_skips_the_ops_without_it(monkeypatch):
    good = _toy_spec(_scan_cumsum)
    other = dataclasses.replace(good, name="toyother", backends={"reference": good.backends["reference"]})
    monkeypatch.setattr(registry, "_OPS", {"toyscan": good, "toyother": other})
    result = invoke("gradcheck", "--op", "all", "--backend", "cumsum")
    assert result.exit_code == 0, result.output
    assert "PASS toyscan" in result.stdout and "toyother" not in result.stdout
    result = invoke("gradcheck", "--op", "all", "--backend", "nosuch")
    assert result.exit_code == 2 and "no op has such a backend" in result.stderr


# -- Ctrl-C while the command starts -----------------------------------------------------------------------------------
# A sitecustomize on PYTHONPATH that sends this process SIGINT when it first imports `module`: the Ctrl-C of a user
# who presses it while Python imports the command line, at a point chosen exactly, not by a timer.
SIGINT_ON_IMPORT = """
import os, signal, sys

class _Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _Interrupt())
"""


def _interrupted_at_import(tmp_path, module: str, *command: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "sitecustomize.py").write_text(SIGINT_ON_IMPORT.format(module=module))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    return subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["typer", "rich.table", "typer.rich_utils"])
def test_ctrl_c_while_the_command_imports_is_one_line_exit_130(tmp_path, module):
    """typer and rich.table are imported with the command line, typer.rich_utils while typer renders the help."""
    done = _interrupted_at_import(tmp_path, module, "-m", "rwkvx_cli", "train", "--help")
    assert (done.returncode, done.stderr, done.stdout) == (130, "interrupted\n", "")


def test_ctrl_c_while_the_console_script_imports_is_one_line_exit_130(tmp_path):
    """The `rwkvx` script pip writes: it imports rwkvx_cli.cli, then calls main()."""
    script = "import sys; sys.argv[0] = '/venv/bin/rwkvx'; from rwkvx_cli.cli import main; sys.exit(main())"
    done = _interrupted_at_import(tmp_path, "typer", "-c", script, "--version")
    assert (done.returncode, done.stderr) == (130, "interrupted\n")


def test_a_program_that_imports_the_package_keeps_pythons_ctrl_c(tmp_path):
    import signal

    done = _interrupted_at_import(tmp_path, "typer", "-c", "import rwkvx_cli.cli")
    assert done.returncode == -signal.SIGINT and done.stderr.endswith("KeyboardInterrupt\n")


def test_every_numeric_option_of_data_prepare_and_merge_states_its_range(tmp_path):
    """Each numeric option has a range (shown in --help) and refuses a value outside it in one line, exit 2,
    nothing written."""
    import inspect
    import typing

    from rwkvx_cli.cli import data_merge, data_prepare

    (tmp_path / "a.txt").write_text("some text\n")
    walked = []
    for name, fn in (("prepare", data_prepare), ("merge", data_merge)):
        for pname, hint in typing.get_type_hints(inspect.unwrap(fn), include_extras=True).items():
            base, *meta = typing.get_args(hint) if typing.get_origin(hint) is typing.Annotated else (hint,)
            if not {int, float} & ({base} | set(typing.get_args(base))):
                continue
            info = next((m for m in meta if hasattr(m, "min")), None)
            assert info is not None and info.min is not None, f"{name} {pname}: no stated range"
            flag = next(iter(info.param_decls or ()), "--" + pname.replace("_", "-"))
            for value in [info.min - 1] + ([info.max + 1] if info.max is not None else []):
                result = invoke("data", name, str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), flag, str(value))
                assert result.exit_code == 2, (flag, value, result.output)
                assert f"Invalid value for '{flag}'" in result.output and result.output.count("\n") == 1, result.output
                assert not (tmp_path / "o").exists()
            walked.append(flag)
    assert {"--seed", "--vocab-size", "--val-fraction", "--workers", "--num-shards", "--eod-id"} <= set(walked)
