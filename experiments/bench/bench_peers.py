"""Extraction against what a user would write instead, in one run at equal threads.

    python -m experiments.bench.bench_peers --peers-python /path/to/peers/bin/python [--n 2000] [--threads 1 2]

The same statements of city_locations (`python -m extract ... limit=N`: label-stratified, whole subjects), every
layer of SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32), written to HDF5 by:
  ours  `python -m extract` (the shared prefix run once and stored once, token rows without padding);
  hf    a plain `output_hidden_states=True` forward + h5py;
  nnsight  a trace saving each block's output + h5py;
  transformer_lens  `run_with_cache` of each block's resid_post + h5py (where it loads the model; else why not).
The peers read the very token ids our store holds (every statement's whole input, chat template included) and
run in their own virtualenv (experiments/bench/peer_extract.py), length-sorted batches of the same padded-token
budget. Each tool is its own process, timed whole (loading the model included) with its peak RSS; every tool
at each thread count in `--threads` (OMP_NUM_THREADS). Printed: seconds, bytes, peak memory, the ratios peer /
ours (target: ours >= 2x faster than each, store bytes <= 0.45x), and the largest difference between a peer's
stored layer and ours (the same numbers up to float16 rounding, or the comparison would be of different work).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from extract.store import ActivationStore

PEERS = ("hf", "nnsight", "transformer_lens")
ROOT = Path(__file__).resolve().parents[2]


def timed(argv: list[str], threads: int, cwd: Path) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS MiB, exit code, output) of one process at `threads` threads."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - started, usage.ru_maxrss / 1024, proc.returncode, out


def model_dir(store: ActivationStore) -> Path:
    """The Hugging Face copy of the store's GGUF model that extraction made (extract.models' cache)."""
    from extract.models import CACHE_DIR

    found = sorted((CACHE_DIR / "hf").glob(f"*-{store.attrs['model_fingerprint'][:16]}/config.json"))
    if not found:
        sys.exit("no Hugging Face copy of the store's model in the cache: run `python -m extract` on it first")
    return found[0].parent


def largest_difference(ours: ActivationStore, peer: Path, layers: list[int]) -> float:
    """max |peer - ours| over `layers`, every token (float32 of both stored values)."""
    import h5py

    with h5py.File(peer) as f:
        return max(float(np.abs(f[f"layers/{k}"][:].astype(np.float32) - ours.layer(k)).max()) for k in layers)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers-python", required=True, help="python of a virtualenv with nnsight, transformer_lens, h5py")
    ap.add_argument("--n", type=int, default=2000, help="statements")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    args = ap.parse_args(argv)
    versions = subprocess.run([args.peers_python, "-c", "import importlib.metadata as m; print(', '.join(f'{p} ' "
                               "f'{m.version(p)}' for p in ('torch', 'transformers', 'nnsight', 'transformer_lens')))"],
                              capture_output=True, text=True).stdout.strip()
    print(f"{args.n} city_locations statements, every layer of SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to "
          f"float32), {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; peers: {versions}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        work = Path(tmp)
        results: dict[tuple[str, int], dict] = {}
        for threads in args.threads:
            ours_dir = work / f"ours-{threads}"
            wall, rss, code, out = timed([sys.executable, "-m", "extract", "model=smollm2", "data=city_locations",
                                          f"limit={args.n}", f"store_dir={ours_dir}", f"hydra.run.dir={work}/logs"],
                                         threads, ROOT)
            if code:
                sys.exit("our extraction failed:\n" + out[-2000:])
            path = ours_dir / "smollm2" / "city_locations.h5"
            results["ours", threads] = dict(wall=wall, rss=rss, bytes=path.stat().st_size)
            store = ActivationStore(path)
            inputs = work / "inputs.npz"
            np.savez(inputs, ids=store.token_ids, offsets=store.offsets)
            for tool in PEERS:
                peer_out = work / f"{tool}-{threads}.h5"
                wall, rss, code, out = timed([args.peers_python, str(ROOT / "experiments" / "bench" / "peer_extract.py"),
                                              tool, str(model_dir(store)), str(inputs), str(peer_out)], threads, ROOT)
                if code:
                    last = [line for line in out.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
                    results[tool, threads] = dict(failed=last[0][:300])
                    continue
                diff = largest_difference(store, peer_out, [0, store.n_layers // 2, store.n_layers - 1])
                results[tool, threads] = dict(wall=wall, rss=rss, bytes=peer_out.stat().st_size, diff=diff)
                peer_out.unlink()
            store.close()
            print(f"[{threads} thread(s)]", flush=True)
            ours = results["ours", threads]
            print(f"  ours              {ours['wall']:7.1f} s  {ours['bytes'] / 1e9:.3f} GB  peak RSS "
                  f"{ours['rss']:.0f} MiB", flush=True)
            for tool in PEERS:
                r = results[tool, threads]
                if "failed" in r:
                    print(f"  {tool:17s} did not run: {r['failed']}", flush=True)
                    continue
                print(f"  {tool:17s} {r['wall']:7.1f} s  {r['bytes'] / 1e9:.3f} GB  peak RSS {r['rss']:.0f} MiB;  "
                      f"{tool} / ours = {r['wall'] / ours['wall']:.2f}x wall (target >= 2), store bytes ours / "
                      f"{tool} = {ours['bytes'] / r['bytes']:.3f} (target <= 0.45); max |{tool} - ours| "
                      f"{r['diff']:.2e} (layers 0, L/2, L-1)", flush=True)
    print(json.dumps({f"{k[0]}@{k[1]}": v for k, v in results.items()}))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
