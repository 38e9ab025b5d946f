"""What every mode of `python -m truthfulqa` shares (run.py dispatches the modes, generate.py is one of them):
where a result goes, the decoding tag in its name, where a run ran, the questions it scores."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from toolkit.errors import check_name
from extract.truthfulqa_pack import Question, TruthfulQAError, load_questions


def result_path(cfg: DictConfig) -> Path:
    """<results_dir>/<model.name>/truthfulqa/<mode>-<format>[-<decoding>][-limit<N>].json"""
    mode = cfg.get("mode", "likelihood")
    decoding = f"-{decoding_tag(cfg.generate)}" if mode == "generate" else ""
    suffix = f"-limit{int(cfg.limit)}" if cfg.get("limit") else ""
    return (Path(cfg.results_dir) / check_name(cfg.model.name, "model.name") / "truthfulqa"
            / f"{mode}-{cfg.format}{decoding}{suffix}.json")


def decoding_tag(gen) -> str:
    """greedy-n<max_new_tokens>, or sample-t<temperature>-p<top_p>-s<seed>-n<max_new_tokens>."""
    if gen.temperature == 0:
        return f"greedy-n{gen.max_new_tokens}"
    return f"sample-t{gen.temperature:g}-p{gen.top_p:g}-s{gen.seed}-n{gen.max_new_tokens}"


def machine(loaded) -> str:
    """Where a run ran, as results record it: device, CPU model, cores, torch threads."""
    import torch

    from toolkit.provenance import host

    gpu = f" ({torch.cuda.get_device_name(loaded.device)})" if loaded.device.type == "cuda" else ""
    return f"{loaded.device}{gpu}; {host()}, {torch.get_num_threads()} torch threads"


def select_questions(cfg: DictConfig) -> list[Question]:
    questions = load_questions(cfg.get("data_path"))
    limit = cfg.get("limit")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise TruthfulQAError(f"limit={limit!r}: give a positive number of questions (or null for all)")
        questions = questions[:limit]
    return questions
