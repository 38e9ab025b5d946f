"""What a user would write instead of `python -m extract`: every layer's hidden states of given token sequences
written to HDF5 by nnsight, TransformerLens or plain Hugging Face `output_hidden_states` (run by
experiments/bench/bench_peers.py, in the peers' own virtualenv: it imports nothing of this toolkit).

    python peer_extract.py TOOL MODEL_DIR INPUTS.npz OUT.h5 [BATCH_TOKENS]

INPUTS.npz: `ids` int64 [T] (every statement's whole input, concatenated) and `offsets` int64 [N+1]. The batches
are length-sorted and hold at most BATCH_TOKENS padded tokens (as our extraction plans them), right-padded with
an attention mask; each layer's real tokens are written in statement order to dataset `layers/<k>` [T, d]
float16 (k = 0 the embeddings ... L the last block; `hf`'s layer L is after the final norm, as
`output_hidden_states` gives it), the ids and offsets beside them. Prints one JSON line:
tool, seconds (load, forward + write, total), bytes written, peak RSS (MiB), versions.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import h5py
import numpy as np
import torch


def batches(lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Statement indices in length-sorted batches of at most `batch_tokens` padded tokens."""
    order = np.argsort(-lengths, kind="stable")
    out, current = [], []
    for i in order:
        if current and (len(current) + 1) * int(lengths[current[0]]) > batch_tokens:
            out.append(current)
            current = []
        current.append(int(i))
    return out + ([current] if current else [])


def padded(ids: np.ndarray, offsets: np.ndarray, batch: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [ids[offsets[i]:offsets[i + 1]] for i in batch]
    width = max(len(s) for s in seqs)
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        x[r, :len(s)] = torch.from_numpy(s)
        mask[r, :len(s)] = 1
    return x, mask


def main() -> None:
    tool, model_dir, inputs, out = sys.argv[1:5]
    batch_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
    data = np.load(inputs)
    ids, offsets = data["ids"], data["offsets"]
    lengths = np.diff(offsets)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n_layers, d = hf.config.num_hidden_layers, hf.config.hidden_size
    versions = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    if tool == "nnsight":
        import nnsight
        from nnsight import LanguageModel

        versions["nnsight"] = nnsight.__version__
        lm = LanguageModel(hf, tokenizer=tokenizer, dispatch=True)

        def states(x, mask):
            saved = []
            with torch.inference_mode():
                with lm.trace({"input_ids": x, "attention_mask": mask}):
                    saved.append(lm.model.embed_tokens.output.save())
                    for layer in lm.model.layers:
                        saved.append(layer.output.save())
            return [s[0] if isinstance(s, tuple) else s for s in saved]
    elif tool == "transformer_lens":
        from importlib.metadata import version

        from transformer_lens.model_bridge import TransformerBridge   # (TransformerLens 4: HookedTransformer's successor)

        versions["transformer_lens"] = version("transformer_lens")
        tl = TransformerBridge.boot_transformers(model_dir, hf_model=hf, tokenizer=tokenizer, device="cpu")
        names = ["hook_embed"] + [f"blocks.{k}.hook_resid_post" for k in range(n_layers)]

        def states(x, mask):
            with torch.inference_mode():
                _, cache = tl.run_with_cache(x, attention_mask=mask, names_filter=lambda n: n in names)
            return [cache[n] for n in names]
    elif tool == "hf":
        def states(x, mask):
            with torch.inference_mode():
                return list(hf(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states)
    else:
        sys.exit(f"unknown tool {tool!r}: nnsight, transformer_lens or hf")
    loaded = time.perf_counter()
    starts = offsets[:-1]
    with h5py.File(out, "w") as f:
        f["ids"], f["offsets"] = ids, offsets
        layers = [f.create_dataset(f"layers/{k}", (len(ids), d), dtype="float16") for k in range(n_layers + 1)]
        for batch in batches(lengths, batch_tokens):
            x, mask = padded(ids, offsets, batch)
            hs = states(x, mask)                       # n_layers + 1 of [b, width, d]
            real = mask.bool()
            rows = np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in batch])
            order = np.argsort(rows)
            for k, h in enumerate(hs):
                values = h[real].to(torch.float16).numpy()      # [tokens of the batch, d], batch order
                _scatter(layers[k], rows[order], values[order])
    done = time.perf_counter()

    print(json.dumps({"tool": tool, "load_s": round(loaded - t0, 2), "extract_s": round(done - loaded, 2),
                      "total_s": round(done - t0, 2), "bytes": os.path.getsize(out),
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "versions": versions}))


def _scatter(ds, rows: np.ndarray, values: np.ndarray) -> None:
    """Write `values` [m, d] at the sorted rows `rows` [m] of `ds`, one contiguous run at a time."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    for run_rows, run_values in zip(np.split(rows, breaks), np.split(values, breaks)):
        ds[int(run_rows[0]):int(run_rows[-1]) + 1] = run_values


if __name__ == "__main__":
    main()
