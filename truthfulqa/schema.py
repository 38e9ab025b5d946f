"""Typed schema of `python -m truthfulqa`'s options, checked before any work (see toolkit/schema.py).

Types (booleans included) by the one typed parser, toolkit.schema.typed_options; then the ranges it
cannot express, the format and a writable results_dir, so that a bad option is one line before the
model is loaded, never a traceback after the scoring.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from toolkit.errors import ToolkitError, check_count, check_name, check_writable
from toolkit.schema import literal_config, ModelSchema, option, threads_option, typed_options

MODES = ("likelihood", "verify", "generate")
_HINTS = {"limit": "a whole number >= 1, or null for every question", "batch_size": "a whole number >= 1",
          "generate.max_new_tokens": "a whole number >= 1", "generate.temperature": "a number >= 0",
          "generate.top_p": "a number in (0, 1]", "generate.seed": "a whole number",
          "save_every": "a whole number >= 1", "prefix_cache": "true or false", "n_boot": "a whole number >= 1",
          "seed": "a whole number", "model.instruct": "true or false",
          "judge_references": "0 (every answer) or a whole number >= 1"}


@dataclass
class GenerateOptions:
    max_new_tokens: int = option(50, "mode=generate: at most this many new tokens per answer (it stops earlier at a "
                                 "newline or the chat turn's end)")
    temperature: float = option(0.0, "mode=generate: 0 = greedy decoding; > 0 samples at this temperature")
    top_p: float = option(1.0, "mode=generate, temperature > 0: nucleus sampling mass (1 = the whole distribution)")
    seed: int = option(0, "mode=generate, temperature > 0: sampling seed (each batch seeded from it and its rows)")


@dataclass
class TruthfulQASchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    mode: str = option("likelihood", "likelihood (MC1 / MC2 from log-likelihoods) | verify (P(yes) that an answer is "
                       "correct: MC1 / MC2_verify) | generate (answers generated, judged truthful / informative)")
    format: str = option("lm_eval", "lm_eval (the harness's 6-shot primer) | chat (the model's chat template) | "
                         "plain (no primer)")
    limit: Optional[int] = option(None, "first N questions only")
    data_path: Optional[str] = option(None, "the TruthfulQA CSV; null = data/truthfulqa/TruthfulQA.csv")
    batch_size: int = option(16, "requests (question + choice) per forward pass, longest first")
    save_every: int = option(8, "batches between progress checkpoints (the unit of resumption)")
    prefix_cache: bool = option(True, "run the tokens shared by every request (the primer) once, reuse their cache")
    n_boot: int = option(1000, "bootstrap resamples (over questions) for the 95 % intervals")
    seed: int = option(0, "bootstrap seed")
    judge: Optional[str] = option(None, "mode=generate: the judge, a model config of conf/model/ (null = the model "
                                  "itself)")
    judge_references: int = option(0, "mode=generate: dataset answers judged per question for the agreement check: "
                                   "0 = every correct and incorrect one, N = the first N of each")
    results_dir: str = option("results", "<results_dir>/<model.name>/truthfulqa/<mode>-<format>[-<decoding>]"
                              "[-limit<N>].json")
    threads: Any = threads_option()
    generate: GenerateOptions = field(default_factory=GenerateOptions)


def judge_config(name: str) -> DictConfig:
    """The `model:` config conf/model/<name>.yaml (the judge of mode=generate); one line if there is none."""
    from toolkit.config import CONF_DIR

    path = CONF_DIR / "model" / f"{check_name(name, 'judge')}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
        raise ToolkitError(f"judge={name!r} is not a model config of conf/model/: use one of {known} (or null: "
                           "the model itself)")
    return OmegaConf.load(path)


def validate(cfg: DictConfig) -> DictConfig:
    """The config with every option's type and range checked (a plain DictConfig)."""
    from truthfulqa.likelihood import check_format   # here, not at the top: --help imports this module (no torch)

    checked = typed_options(cfg, TruthfulQASchema, _HINTS)
    if checked["mode"] not in MODES:
        raise ToolkitError(f"mode={checked['mode']!r}: use one of {', '.join(MODES)}")
    check_format(checked["format"])
    check_count(checked["limit"], "limit", none_ok=True)
    for key in ("batch_size", "save_every", "n_boot"):
        check_count(checked[key], key)
    gen = checked["generate"]
    check_count(gen["max_new_tokens"], "generate.max_new_tokens")
    refs = checked["judge_references"]
    if isinstance(refs, bool) or not isinstance(refs, int) or refs < 0:
        raise ToolkitError(f"judge_references={refs!r}: use 0 (every answer, the default) or a whole number >= 1")
    if gen["temperature"] < 0:
        raise ToolkitError(f"generate.temperature={gen['temperature']}: use 0 (greedy) or a positive temperature")
    if not 0 < gen["top_p"] <= 1:
        raise ToolkitError(f"generate.top_p={gen['top_p']}: use a number in (0, 1]")
    if checked["judge"] is not None:
        judge_config(checked["judge"])                       # a judge that is not a model config: one line
    check_name(checked["model"]["name"], "model.name")
    check_writable(checked["results_dir"])
    return literal_config(checked)
