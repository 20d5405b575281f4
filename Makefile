# Every target works from a fresh clone: it creates .venv first when it is missing or stale.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# requirements.lock pins every package; uv installs it in seconds. Without uv on PATH the lock's own uv pin is
# bootstrapped into the venv with pip. UV=false installs the same pins with pip alone (slower, no resolver).
# --compile-bytecode: every test spawns Python processes, and without .pyc files (PYTHONDONTWRITEBYTECODE is set
# on some machines) each would recompile torch, transformers and prefect on import.
UV ?= $(shell command -v uv 2>/dev/null || echo $(VENV)/bin/uv)
LOCK_EXTRAS := --extra dev --extra bench --extra retro
STORE ?= ./artifacts
# make pretrain MODEL=bert|t5|hybrid|gpt: the model family (BERT and T5 get sentence-split WordPiece data)
MODEL ?= gpt
# make eval MODEL=hybrid: the report puts the GPT of the same flags and data beside it (BASELINE= for none)
BASELINE ?= $(if $(filter gpt,$(MODEL)),,gpt)
# make retro RETRO_CORPUS=kjv: the embedded King James Bible, cleaned and deduplicated as prose, instead of the
# standard-library code the Retro flow reads by default
RETRO_CORPUS ?= stdlib
RETRO_KJV := --corpus.download '{"source": "stages/corpora/kjv.jsonl.xz"}' --corpus.clean '{}' --corpus.dedup '{}'
PYTEST_ARGS ?=

.PHONY: setup lock test test-fast lint bench corpus pretrain eval demo retro clean gpu-check

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(UV),false)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements.lock -e .
else
	test -x $(UV) || $(PY) -m pip install -q --disable-pip-version-check $$(grep '^uv==' requirements.lock)
	$(UV) pip sync -q --compile-bytecode --python $(PY) requirements.lock
	$(UV) pip install -q --python $(PY) --no-deps -e .
endif
	touch $(STAMP)

setup: $(STAMP)

# Re-pin after changing pyproject.toml or constraints.txt (the CPU torch wheel lies in /opt/wheels).
lock: setup
	$(VENV)/bin/uv pip compile -q pyproject.toml $(LOCK_EXTRAS) -c constraints.txt --python $(PY) \
		--find-links /opt/wheels --emit-find-links --custom-compile-command "make lock" -o requirements.lock

# The whole suite in TEST_WORKERS pytest-xdist processes, each taking whole test files (--dist loadfile: a file's
# module fixtures, such as a trained checkpoint, are built once) in the order tests/conftest.py gives them (longest
# first); the 25 slowest tests are listed at the end.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# The tests that start no process (no torchrun, gloo group, subprocess or server) and are not marked slow.
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not processes and not slow" --durations=10 $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: setup
	@for b in benchmarks/*.py; do m=$$(basename $$b .py); echo "== benchmarks.$$m"; $(PY) -m benchmarks.$$m || exit 1; done

# The GPU machine's own python3 and CUDA torch: no venv, nothing installed, no network (megatron_train/tools/gpu_check.py).
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m megatron_train.tools.gpu_check

corpus: setup
	$(PY) -m flows.corpus_plan --store $(STORE)

pretrain: setup
	$(PY) -m flows.pretrain --store $(STORE) --model $(MODEL)

eval: setup
	$(PY) -m flows.eval --store $(STORE) --model $(MODEL) $(if $(BASELINE),--baseline $(BASELINE))

demo: setup
	$(PY) -m flows.demo --store $(STORE)

retro: setup
	$(PY) -m flows.retro_flow --corpus.store $(STORE) $(if $(filter kjv,$(RETRO_CORPUS)),$(RETRO_KJV))

clean:
	rm -rf $(STORE) .pytest_cache
