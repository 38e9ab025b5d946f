#!/usr/bin/env bash
# GPU check (one command, under 10 minutes on one GPU; CPU CI never runs it):
#   bash experiments/bench/gpu_check.sh [n_statements]        (default 2000; DEVICE=cpu for a dry run)
# 1. extraction of SmolLM2 city_locations on CUDA in bfloat16, every layer (hooks, pinned-memory
#    side-stream copies, the shared prefix run once from its key/value cache and stored once), timed,
#    and its stored states checked against a plain single-statement forward with
#    output_hidden_states=True; then the same extraction without the shared prefix (prefix_cache=false,
#    schema 1), timed, its store's bytes and every layer of every statement compared with the first;
# 2. the linear probe (batched CV) and sAwMIL fitted on CUDA on that store, timed: one sAwMIL fit and its
#    C by grouped CV (3 folds x 3 C + the final fit, one head), then one fit on synthetic bags of
#    Llama-3.1-8B width (d = 4096, 2929 bags: the city_locations training split's size);
# 3. make run's unit of work on CUDA: every city_locations statement at layer 16 (make run's dtypes), then one
#    samil layer job (five tasks, C by grouped CV, out-of-fold calibration) at one CPU thread, timed: compare
#    with the CPU job seconds of docs/results/make_run.md.
# 4. `make run` with RUN_ACCELERATOR=auto on every core (stopped after MAKE_RUN_LIMIT seconds, default 420).
# Prints one line per measurement; `python -m experiments.bench.page --gpu-log LOG` puts them on docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
N=${1:-2000}
DEVICE=${DEVICE:-cuda}
ACCEL=$([ "$DEVICE" = cuda ] && echo gpu || echo cpu)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# the provenance line that `python -m experiments.bench.page --gpu-log LOG` puts on the benchmarks page
# (COMMIT=<hash> where the working tree travels without its .git)
"$PY" - "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" <<'EOF'
import sys
from datetime import datetime, timezone

import torch

from toolkit.provenance import host

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"gpu_check: commit {sys.argv[1][:7]}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {host()}, {gpu}; "
      f"torch {torch.__version__}")
EOF

SECONDS=0
"$PY" -m extract model=smollm2 data=city_locations limit="$N" model.device="$DEVICE" model.dtype=bfloat16 \
    dtype=bfloat16 store_dir="$WORK" hydra.run.dir="$WORK/logs" 2>&1 | tr '\r' '\n' | grep -v "stmt/s" | tail -2
echo "extract: $N statements, every layer, bfloat16 on $DEVICE, shared prefix: ${SECONDS} s (model load included)"
SECONDS=0
"$PY" -m extract model=smollm2 data=city_locations limit="$N" model.device="$DEVICE" model.dtype=bfloat16 \
    dtype=bfloat16 prefix_cache=false store_dir="$WORK/whole" hydra.run.dir="$WORK/logs_whole" 2>&1 | tr '\r' '\n' \
    | grep -v "stmt/s" | tail -1
echo "extract: the same without the shared prefix (prefix_cache=false): ${SECONDS} s (model load included)"
"$PY" - "$WORK/smollm2/city_locations.h5" "$WORK/whole/smollm2/city_locations.h5" <<'EOF'
"""The shared-prefix store (schema 2) reads as the whole-input store (schema 1): bytes and values."""
import os
import sys

import numpy as np

from extract.store import ActivationStore

with ActivationStore(sys.argv[1]) as a, ActivationStore(sys.argv[2]) as b:
    assert (a.offsets == b.offsets).all() and (a.token_ids == b.token_ids).all()
    worst = 0.0   # per layer ||x - y|| / ||y|| (one element's max-normalised difference is no measure in bfloat16:
                  # a massive-activation dimension forming at one layer can move by 20 % between two bf16 passes)
    for k in a.layers:
        x, y = a.layer(k).astype(np.float64), b.layer(k).astype(np.float64)
        worst = max(worst, float(np.linalg.norm(x - y) / (np.linalg.norm(y) + 1e-12)))
    print(f"shared prefix {a.prefix_len} tokens: store bytes {os.path.getsize(sys.argv[1]) / os.path.getsize(sys.argv[2]):.3f}"
          f" of the whole-input store's; relative difference ||x - y|| / ||y|| at most {worst:.2e} over {len(a.layers)} "
          f"layers ({'OK' if worst < 2e-2 else 'MISMATCH'}: bfloat16, cached vs whole passes)")
EOF

"$PY" - "$WORK/smollm2/city_locations.h5" "$DEVICE" <<'EOF'
"""Stored states == a plain single-statement bfloat16 forward (output_hidden_states), 20 statements."""
import sys

import numpy as np
import torch

from toolkit.config import compose_config
from extract.models import load_model
from extract.store import ActivationStore

path, device = sys.argv[1], sys.argv[2]
loaded = load_model(compose_config("extract", "model=smollm2", f"model.device={device}", "model.dtype=bfloat16").model)
worst = 0.0
with ActivationStore(path) as store, torch.inference_mode():
    ids, off = store.token_ids, store.offsets
    layers = {k: store.layer(k) for k in range(1, store.n_layers)}   # k < L: HF's hidden_states[k] (L has the final norm)
    for i in np.linspace(0, store.n_statements - 1, 20).astype(int):
        x = torch.from_numpy(ids[off[i]:off[i + 1]])[None].to(loaded.model.device)
        hidden = loaded.model(x, output_hidden_states=True).hidden_states
        for k, stored in layers.items():
            ref = hidden[k][0].double().cpu().numpy()
            got = stored[off[i]:off[i + 1]].astype(np.float64)
            worst = max(worst, float(np.linalg.norm(got - ref) / (np.linalg.norm(ref) + 1e-12)))
print(f"stored vs plain forward: relative error ||x - y|| / ||y|| at most {worst:.2e} over 20 statements x "
      f"{len(layers)} layers ({'OK' if worst < 5e-2 else 'MISMATCH'}: bfloat16 batched vs single passes)")
EOF

"$PY" -m experiments.bench.bench_linear --store "$WORK/smollm2/city_locations.h5" --layer 16 --accelerator "$ACCEL" 2>&1 | tail -4
"$PY" experiments/bench/bench_samil.py --skip-package --sizes 250 --big 0 --device "$DEVICE" \
    --store "$WORK/smollm2/city_locations.h5" --layer 16 2>&1 | tail -6
"$PY" experiments/bench/bench_samil.py --skip-package --big 2929 --dim 4096 --device "$DEVICE" 2>&1 | tail -6

SECONDS=0
"$PY" -m extract model=smollm2 data=city_locations "layers=[16]" model.device="$DEVICE" store_dir="$WORK/full" \
    hydra.run.dir="$WORK/logs_full" 2>&1 | tr '\r' '\n' | grep -v "stmt/s" | tail -1
echo "extract: every city_locations statement, layer 16, make run's dtypes, on $DEVICE: ${SECONDS} s (model load included)"
SECONDS=0
"$PY" -m train_probe model=smollm2 data=city_locations probe=samil layer=16 \
    'tasks=[true_vs_all,false_vs_all,neither_vs_all,multiclass,true_vs_false]' trainer.accelerator="$ACCEL" threads=1 \
    store_dir="$WORK/full" results_dir="$WORK/results" hydra.run.dir="$WORK/logs_job" 2>&1 | tr '\r' '\n' \
    | grep -v "%|" | tail -3
echo "samil layer job (layer 16, five tasks, C by grouped CV, out-of-fold calibration), one CPU thread, on $DEVICE =" \
    "${SECONDS} s (target <= 5 s)"

# 4. make run itself (its commands, without its install step: nothing is downloaded here), the probe jobs on the
#    accelerator (RUN_ACCELERATOR=auto) on every core, stopped after MAKE_RUN_LIMIT seconds
LIMIT=${MAKE_RUN_LIMIT:-420}
SECONDS=0
if timeout "$LIMIT" make -o install run PY="$PY" RUN_ACCELERATOR=auto RUN_WORKERS="$(nproc)" > "$WORK/make_run.log" 2>&1
then
    echo "make run (RUN_ACCELERATOR=auto, $(nproc) workers, on $DEVICE) = ${SECONDS} s (target <= 300 s)"
else
    echo "make run (RUN_ACCELERATOR=auto, $(nproc) workers, on $DEVICE) = ${SECONDS} s (target <= 300 s): stopped" \
        "or failed (exit code $?); its last line: $(tail -c 300 "$WORK/make_run.log" | tr '\r\n' '  ')"
fi
