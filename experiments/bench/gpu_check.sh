#!/usr/bin/env bash
# GPU check (one command, under 8 minutes on one GPU; CPU CI never runs it):
#   bash experiments/bench/gpu_check.sh [n_statements]        (default 2000; DEVICE=cpu for a dry run)
# 1. extraction of SmolLM2 city_locations on CUDA in bfloat16, every layer (hooks, pinned-memory
#    side-stream copies), timed, and its stored states checked against a plain single-statement
#    forward with output_hidden_states=True;
# 2. the linear probe (batched CV) and sAwMIL fitted on CUDA on that store, timed: one sAwMIL fit and its
#    C by grouped CV (3 folds x 3 C + the final fit, one head), then one fit on synthetic bags of
#    Llama-3.1-8B width (d = 4096, 2929 bags: the city_locations training split's size).
# Prints one line per measurement; put the figures in the README as GPU figures.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
N=${1:-2000}
DEVICE=${DEVICE:-cuda}
ACCEL=$([ "$DEVICE" = cuda ] && echo gpu || echo cpu)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

SECONDS=0
"$PY" -m extract model=smollm2 data=city_locations limit="$N" model.device="$DEVICE" model.dtype=bfloat16 \
    dtype=bfloat16 store_dir="$WORK" hydra.run.dir="$WORK/logs" 2>&1 | tr '\r' '\n' | grep -v "stmt/s" | tail -2
echo "extract: $N statements, every layer, bfloat16 on $DEVICE: ${SECONDS} s (model load included)"

"$PY" - "$WORK/smollm2/city_locations.h5" "$DEVICE" <<'EOF'
"""Stored states == a plain single-statement bfloat16 forward (output_hidden_states), 20 statements."""
import sys

import numpy as np
import torch

from extract.config import compose_config
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
            ref = hidden[k][0].float().cpu().numpy()
            got = stored[off[i]:off[i + 1]]
            worst = max(worst, float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-6)))
print(f"stored vs plain forward: max relative error {worst:.2e} over 20 statements x {len(layers)} layers "
      f"({'OK' if worst < 5e-2 else 'MISMATCH'}: bfloat16 batched vs single passes)")
EOF

"$PY" -m experiments.bench.bench_linear --store "$WORK/smollm2/city_locations.h5" --layer 16 --accelerator "$ACCEL" 2>&1 | tail -4
"$PY" experiments/bench/bench_samil.py --skip-package --sizes 250 --big 0 --device "$DEVICE" \
    --store "$WORK/smollm2/city_locations.h5" --layer 16 2>&1 | tail -6
"$PY" experiments/bench/bench_samil.py --skip-package --big 2929 --dim 4096 --device "$DEVICE" 2>&1 | tail -6
