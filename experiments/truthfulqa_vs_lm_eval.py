"""Cross-check `python -m truthfulqa` (format=lm_eval) against lm-evaluation-harness itself.

    python -m experiments.truthfulqa_vs_lm_eval --n 100 [--lm-eval-venv /tmp/lmeval-venv] [--work /tmp/tqa_vs]

1. the vendored CSV -> <work>/truthfulqa.jsonl (question, mc1_targets / mc2_targets {choices, labels}
   exactly as extract/truthfulqa_pack.py builds them);
2. local task YAMLs = the installed harness's truthfulqa_mc1.yaml / truthfulqa_mc2.yaml (+ its
   utils.py), with only the dataset (json, data_files -> the JSONL, validation split), the task names
   (tqa_local_mc1 / mc2) and the tag changed;
3. `lm_eval --model hf` (SmolLM2's converted HF checkpoint, float32, CPU) on the first N questions
   with --log_samples, in the separate virtualenv (lm-eval[hf]==0.4.13);
4. ours on the same N questions; compares contexts / continuations, every per-choice
   log-likelihood (max |diff|), per-question MC1 / MC2 and their means. Writes <work>/comparison.json.

The virtualenv: python3 -m venv /tmp/lmeval-venv; pip install torch==2.13.0 (CPU) first, then
pip install "lm-eval[hf]==0.4.13".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from toolkit.config import compose_config
from extract.models import load_model
from extract.truthfulqa_pack import load_questions
from truthfulqa.likelihood import context_text
from evaluation.multiple_choice import mc_scores
from truthfulqa.run import run

DATASET_LINES = "dataset_path: truthfulqa/truthful_qa\ndataset_name: multiple_choice\n"


def write_jsonl(path: Path) -> None:
    with path.open("w") as f:
        for q in load_questions():
            f.write(json.dumps({"question": q.question,
                                "mc1_targets": {"choices": q.mc1_choices, "labels": [1] + [0] * len(q.incorrect)},
                                "mc2_targets": {"choices": q.mc2_choices, "labels": q.mc2_labels}}) + "\n")


def write_tasks(task_dir: Path, jsonl: Path, venv: Path) -> None:
    """Copies of the harness's own truthfulqa_mc1 / mc2 task files, pointed at the JSONL."""
    harness = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                   "import lm_eval, os; print(os.path.dirname(lm_eval.__file__))"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    src = harness / "tasks" / "truthfulqa"
    task_dir.mkdir(parents=True, exist_ok=True)
    mc1 = (src / "truthfulqa_mc1.yaml").read_text()
    mc2 = (src / "truthfulqa_mc2.yaml").read_text()
    dataset = (f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n"
               f"  data_files:\n    validation: {jsonl}\n")
    for old, new in ((DATASET_LINES, dataset), ("tag:\n  - truthfulqa\n", ""),
                     ("task: truthfulqa_mc1\n", "task: tqa_local_mc1\n")):
        if old not in mc1:
            raise SystemExit(f"{src / 'truthfulqa_mc1.yaml'} has changed: cannot find {old!r}")
        mc1 = mc1.replace(old, new)
    if "task: truthfulqa_mc2\n" not in mc2:
        raise SystemExit(f"{src / 'truthfulqa_mc2.yaml'} has changed")
    (task_dir / "truthfulqa_mc1.yaml").write_text(mc1)
    (task_dir / "truthfulqa_mc2.yaml").write_text(mc2.replace("task: truthfulqa_mc2\n", "task: tqa_local_mc2\n"))
    (task_dir / "utils.py").write_text((src / "utils.py").read_text())


def run_harness(venv: Path, model_dir: str, task_dir: Path, out: Path, n: int, batch_size: int) -> dict:
    """Run lm_eval; returns {task: (aggregate acc, [samples sorted by doc_id])}."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(venv / "bin" / "lm_eval"), "--model", "hf",
           "--model_args", f"pretrained={model_dir},dtype=float32", "--tasks", "tqa_local_mc1,tqa_local_mc2",
           "--include_path", str(task_dir), "--limit", str(n), "--log_samples", "--output_path", str(out),
           "--device", "cpu", "--batch_size", str(batch_size)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    found = {}
    for task in ("tqa_local_mc1", "tqa_local_mc2"):
        path = max(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
        samples = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
        found[task] = (float(results["results"][task]["acc,none"]), samples)
    return found


def compare(ours: dict, harness: dict) -> dict:
    """Per-choice log-likelihood differences and MC1 / MC2, ours vs the harness."""
    questions = load_questions()
    diffs, n_context_mismatch = [], 0
    theirs = {"mc1": [], "mc2": []}
    for kind, task in (("mc1", "tqa_local_mc1"), ("mc2", "tqa_local_mc2")):
        for q, s in zip(ours["questions"], harness[task][1]):
            ll = np.array([r[0] for r in s["filtered_resps"]], dtype=np.float64)
            theirs[kind].append(ll)
            diffs.append(np.abs(ll - np.array(q[f"{kind}_logliks"])))
            choices = getattr(questions[q["row"]], f"{kind}_choices")
            expected = [[context_text("lm_eval", questions[q["row"]].question), " " + c] for c in choices]
            args = [[a["arg_0"], a["arg_1"]] for a in s["arguments"].values()]   # gen_args_0, gen_args_1, ...
            n_context_mismatch += sum(a != e for a, e in zip(args, expected)) + abs(len(args) - len(expected))
    their_mc1, their_mc2 = mc_scores(theirs["mc1"], theirs["mc2"], [q["mc2_labels"] for q in ours["questions"]])
    our_mc1, our_mc2 = mc_scores([q["mc1_logliks"] for q in ours["questions"]],
                                 [q["mc2_logliks"] for q in ours["questions"]],
                                 [q["mc2_labels"] for q in ours["questions"]])
    harness_mc1 = np.array([s["acc"] for s in harness["tqa_local_mc1"][1]])
    harness_mc2 = np.array([s["acc"] for s in harness["tqa_local_mc2"][1]])
    all_diffs = np.concatenate(diffs)
    return {
        "n_questions": ours["n_questions"], "n_logliks": int(all_diffs.size),
        "max_abs_loglik_diff": float(all_diffs.max()), "mean_abs_loglik_diff": float(all_diffs.mean()),
        "n_requests_with_other_context_or_continuation": int(n_context_mismatch),
        "mc1": {"ours": ours["mc1"], "harness": harness["tqa_local_mc1"][0],
                "questions_differing": int((our_mc1 != harness_mc1).sum())},
        "mc2": {"ours": ours["mc2"], "harness": harness["tqa_local_mc2"][0],
                "max_abs_question_diff": float(np.abs(our_mc2 - harness_mc2).max()),
                "harness_per_question_recomputed_max_diff": float(np.abs(their_mc2 - harness_mc2).max())},
        "harness_mc1_recomputed_differing": int((their_mc1 != harness_mc1).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100, help="first N questions")
    parser.add_argument("--lm-eval-venv", type=Path, default=Path("/tmp/lmeval-venv"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/tqa_vs_lm_eval"))
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    jsonl = work / "truthfulqa.jsonl"
    write_jsonl(jsonl)
    write_tasks(work / "tasks", jsonl, args.lm_eval_venv)
    model_dir = load_model(compose_config("truthfulqa", "model=smollm2").model).model.name_or_path
    harness = run_harness(args.lm_eval_venv, model_dir, work / "tasks", work / "lm_eval_out", args.n,
                          args.batch_size)
    cfg = compose_config("truthfulqa", "model=smollm2", f"limit={args.n}", f"results_dir={work / 'ours'}",
                         "model.device=cpu")
    ours = json.loads(run(cfg).read_text())
    report = {"model_dir": model_dir, **compare(ours, harness)}
    (work / "comparison.json").write_text(json.dumps(report, indent=1))
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
