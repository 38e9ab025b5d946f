"""`python -m zero_shot model=... data=... [enumeration=...] [scores=...]`: compose the config, score the
statements (or load saved scores) and write the zero-shot result cells."""
from extract.config import answer_help
from zero_shot.schema import ZeroShotSchema

answer_help(__name__, "zero_shot", ZeroShotSchema)   # before the imports below: --help needs no torch

import logging

from omegaconf import DictConfig

from extract.errors import hydra_main, run_entry
from zero_shot.run import run

log = logging.getLogger("zero_shot")


@hydra_main(config_path="../conf", config_name="zero_shot")
def main(cfg: DictConfig) -> None:
    paths = run_entry(run, cfg, log=log)
    if paths is not None:
        log.info("%d files under %s", len(paths), cfg.results_dir)


if __name__ == "__main__":
    main()
