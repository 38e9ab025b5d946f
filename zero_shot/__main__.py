"""`python -m zero_shot model=... data=... [enumeration=...] [scores=...]`: compose the config, score the
statements (or load saved scores) and write the zero-shot result cells."""
import logging
import sys

import hydra
from omegaconf import DictConfig

from extract.models import ModelError
from extract.statements import StatementsError
from probes.data import TaskError
from probes.splits import SplitError
from zero_shot.prompts import PromptError
from zero_shot.run import ZeroShotError, run

log = logging.getLogger("zero_shot")


@hydra.main(version_base="1.3", config_path="../conf", config_name="zero_shot")
def main(cfg: DictConfig) -> None:
    try:
        paths = run(cfg)
    except (StatementsError, ModelError, PromptError, ZeroShotError, SplitError, TaskError, ValueError) as err:
        log.error("%s", err)
        sys.exit(1)
    log.info("%d files under %s", len(paths), cfg.results_dir)


if __name__ == "__main__":
    main()
