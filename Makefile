# The two commands of the README: `make demo` (the main job) and `make test`.
# Each sets up .venv by itself on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench gpu-check clean-venv bytecode

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: pip takes the CPU build from local disk; an unpinned torch pulls CUDA.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# The package's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set, every process that
# imports it (serve, each agent, zygote and exec'd worker) would compile ~0.4 s of it again. Python checks each file's source time, so a stale one is compiled again, never run.
bytecode: $(STAMP)
	$(PY) -m compileall -q src

demo: $(STAMP) bytecode
	$(VENV)/bin/elastic-ep demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts

test: $(STAMP) lint bytecode
	bash scripts/install-netbed-deps.sh
	$(VENV)/bin/pytest -q

# The GPU checks (scripts/gpu_check.py): says so and exits 0 where there is no CUDA device.
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py --out gpu_check.json

bench: $(STAMP)
	for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
