"""`make test` runs pytest-xdist with `--dist loadgroup`, and tests/ops/test_cpu_isa.py marks its
tests `xdist_group("native-builds")` so that one worker compiles each native build once, not both
workers each. pytest 9.2 silently undoes that grouping with pytest-xdist 3.8
(pytest-dev/pytest-xdist#1386: the group rides on a node id that pytest 9.2 no longer reads back),
so pyproject.toml caps pytest below 9.2; this holds the grouping itself, not the version."""

import subprocess
import sys


def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(
        "import os, pathlib, pytest\n"
        "pytestmark = pytest.mark.xdist_group('one')\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_it(i):\n"
        "    pathlib.Path(f'worker-{i}').write_text(os.environ['PYTEST_XDIST_WORKER'])\n"
    )
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"],
        cwd=tmp_path, check=True, capture_output=True, text=True,
    )
    workers = {p.read_text() for p in tmp_path.glob("worker-*")}
    assert len(list(tmp_path.glob("worker-*"))) == 8
    assert len(workers) == 1, f"one xdist_group ran on {sorted(workers)}"
