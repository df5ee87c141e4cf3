# rwkvx developer entry points. Every target creates/refreshes .venv first.
#
# torch is installed before the project: the CPU build by default. A GPU user
# picks their own, e.g.  make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# (or installs torch into .venv beforehand: an importable torch is kept).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# The runtime install (the project and its dependencies) serves the main job: demo, bench,
# gradcheck. The test tools (pytest, ruff, hypothesis, the rwkv package, triton: the `test`
# extra) are added on top by `make test` and `make lint` only.
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# pytest-xdist workers for the suites (`auto`: one per core; tests/conftest.py shares the cores out
# among them). TEST_WORKERS=0 runs in this process, as one test file under plain pytest does.
TEST_WORKERS ?= auto

.PHONY: install test lint gradcheck bench demo demo-rwkvx gpu-compile gpu-compile-test test-slow test-aarch64 gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH_SPEC)
	$(BIN)/pip install -e .
	touch $@

$(TEST_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -e '.[test]'
	touch $@

test: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=30

lint: $(TEST_STAMP)
	$(BIN)/ruff check .

# The main job: train the tiny RWKV-7 on the bundled Shakespeare (CPU, minutes),
# ending with validation bits per byte and a generated sample. --resume makes a rerun safe:
# an interrupted demo continues from its last checkpoint, a finished one has nothing to do,
# and with no checkpoint yet it starts at step 0 (delete runs/tiny to train it afresh).
demo: $(STAMP)
	$(BIN)/rwkvx train --config configs/tiny.yaml --resume

demo-rwkvx: $(STAMP)
	$(BIN)/rwkvx train --config configs/tiny-rwkvx.yaml --resume

# Prove the kernels' gradients (both gates, every production backend).
gradcheck: $(STAMP)
	$(BIN)/rwkvx gradcheck --op all

# The standard CPU benchmark set (every op at its default shapes, fwd+bwd, fp32), replacing bench/cpu.json.
bench: $(STAMP)
	$(BIN)/rwkvx bench --json bench/cpu.json --force

# Compile every Triton kernel ahead of time for sm_80 and sm_90 (no GPU needed) and print
# shared memory, registers and spills per kernel; the -test variant asserts the limits (CI).
gpu-compile: $(TEST_STAMP)
	$(BIN)/python -m rwkvx_cli.tools.compile_gate

gpu-compile-test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m gpu_compile tests/tools/test_compile_gate.py

# The tests of many minutes each (the compile gate, torch.compile with a warm cache): CI runs them.
test-slow: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "slow or gpu_compile" --durations=20

# The aarch64 (NEON) build of the CPU kernels, cross-compiled and run under qemu-user, through
# both gradient-check gates (part of test-slow). Needs Debian's g++-aarch64-linux-gnu and
# qemu-user (`apt-get install g++-aarch64-linux-gnu qemu-user`); fails, not skips, without them.
test-aarch64: $(TEST_STAMP)
	RWKVX_REQUIRE_CROSS=1 $(BIN)/python -m pytest -q -m slow tests/ops/test_aarch64.py

# On a GPU box: gradcheck every CUDA backend, bench wkv7 (fla's chunk_rwkv7 as a peer row
# when FLA_WHEELS=<folder of fla wheels>), 200 bf16 training steps of configs/gpu-0.1b.yaml,
# the CUDA `auto` choices -> bench/gpu.json, bench/gpu.md (replaced). Offline, with the box's own python
# (CUDA torch + Triton) and the package from this checkout: no venv, nothing downloaded.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m rwkvx_cli.tools.gpu_check --out bench --force

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
