# rwkvx developer entry points. Every target creates/refreshes .venv first.
#
# torch is installed before the project: the CPU build by default. A GPU user
# picks their own, e.g.  make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# (or installs torch into .venv beforehand: an importable torch is kept).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint gradcheck bench demo demo-rwkvx clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH_SPEC)
	$(BIN)/pip install -e '.[test]'
	touch $@

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

# The main job: train the tiny RWKV-7 on the bundled Shakespeare (CPU, minutes),
# ending with validation bits per byte and a generated sample.
demo: $(STAMP)
	$(BIN)/rwkvx train --config configs/tiny.yaml

demo-rwkvx: $(STAMP)
	$(BIN)/rwkvx train --config configs/tiny-rwkvx.yaml

# Prove the kernels' gradients (both gates, every production backend).
gradcheck: $(STAMP)
	for op in wkv7 moba wkv4 rwkv8 gdn kda; do $(BIN)/rwkvx gradcheck --op $$op || exit 1; done

# The standard CPU benchmark set (every op at its default shapes, fwd+bwd, fp32).
bench: $(STAMP)
	$(BIN)/rwkvx bench --json bench/cpu.json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
