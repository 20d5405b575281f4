# Every target works from a fresh clone: it creates .venv first when it is missing or stale.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STORE ?= ./artifacts
PYTEST_ARGS ?=

.PHONY: setup test lint bench corpus pretrain eval demo retro clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,bench,retro]'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: setup
	@for b in benchmarks/*.py; do m=$$(basename $$b .py); echo "== benchmarks.$$m"; $(PY) -m benchmarks.$$m || exit 1; done

corpus: setup
	$(PY) -m flows.corpus --store $(STORE)

pretrain: setup
	$(PY) -m flows.pretrain --store $(STORE)

eval: setup
	$(PY) -m flows.eval --store $(STORE)

demo: setup
	$(PY) -m flows.demo --store $(STORE)

retro: setup
	@echo "make retro: the Retro pipeline (chunk database, embedder, faiss index, neighbours) is not built yet." >&2
	@exit 2

clean:
	rm -rf $(STORE) .pytest_cache
