"""`dry_run=true`: what an extraction will compute and write, stated before any work, from the model's
config and tokenizer alone (extract.models.load_spec; no weights loaded): statements, tokens (read,
and distinct: a shared prefix counted once), bytes per layer and in all, the free disk, and a time
estimate from a forward throughput measured on this kind of device. A plan the disk cannot hold is
refused, as the real run would be."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from toolkit.disk import check_space, format_bytes

# forward tokens per second (distinct tokens, every layer captured, store written), by model.name and
# device type; tokens_per_s= overrides them. Measured on 2 CPU cores shared with other work (load
# ~10): SmolLM2 by experiments/bench/bench_extract.py (29,246 distinct tokens of 2000 city
# statements in 486 s), the tiny model by a limit=600 extraction; an idle machine is faster.
MEASURED_TOKENS_PER_S = {("tiny", "cpu"): 580, ("smollm2", "cpu"): 60}


@dataclass
class Plan:
    """The numbers of one extraction (tokens: model inputs; bytes: the store file)."""
    path: Path
    n_statements: int
    n_tokens: int              # tokens of every input, the shared prefix in each
    n_distinct: int            # tokens computed and stored: the shared prefix once
    prefix_len: int
    n_layers: int              # layers stored
    layer_bytes: int           # one layer's rows
    total_bytes: int           # the whole store
    total_without_prefix: int  # the whole store with prefix_cache=false
    free_bytes: int
    tokens_per_s: float | None
    device: str

    def lines(self) -> list[str]:
        seconds = None if not self.tokens_per_s else self.n_distinct / self.tokens_per_s
        time = (f"about {_duration(seconds)} at {self.tokens_per_s:,.0f} tokens/s on {self.device}"
                if seconds is not None else f"unknown (no measured throughput for this model on {self.device}: "
                                              "give tokens_per_s=...)")
        return [f"plan for {self.path}",
                f"  statements      {self.n_statements:,}",
                f"  tokens          {self.n_tokens:,} read, {self.n_distinct:,} distinct "
                f"({self.prefix_len} shared prefix tokens computed and stored once)",
                f"  bytes per layer {format_bytes(self.layer_bytes)} x {self.n_layers} layers",
                f"  store           {format_bytes(self.total_bytes)} ({format_bytes(self.total_without_prefix)} "
                "without the shared prefix)",
                f"  free disk       {format_bytes(self.free_bytes)}",
                f"  time            {time}"]


def free_space(folder: Path) -> int:
    """Free bytes on the disk of `folder` (created or not)."""
    folder = folder.absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_plan(plan: Plan, reclaimable: int = 0) -> None:
    """Refuse (one line, toolkit.disk.NoSpace) a plan whose store the disk cannot hold."""
    check_space(plan.path.parent, plan.total_bytes, reclaimable=reclaimable)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
