"""`python -m truthfulqa model=... [format=lm_eval|chat|plain] [limit=N] [results_dir=...]`: score every
TruthfulQA choice, write the MC1 / MC2 result JSON and print both with their intervals."""
from extract.config import answer_help
from truthfulqa.schema import TruthfulQASchema

answer_help(__name__, "truthfulqa", TruthfulQASchema)   # before the imports below: --help needs no torch

import logging

from omegaconf import DictConfig

from extract.errors import hydra_main, run_entry
from truthfulqa.run import run

log = logging.getLogger("truthfulqa")


@hydra_main(config_path="../conf", config_name="truthfulqa")
def main(cfg: DictConfig) -> None:
    run_entry(run, cfg, log=log)


if __name__ == "__main__":
    main()
