"""`python -m train_probe probe=... task=... layer=...`: compose the config, train, write result cells."""
from extract.config import answer_help
from probes.schema import TrainProbeSchema

answer_help(__name__, "train_probe", TrainProbeSchema)   # before the imports below: --help needs no torch

import logging

from omegaconf import DictConfig

from extract.errors import hydra_main, run_entry
from probes.pipeline import train_probes

log = logging.getLogger("train_probe")


@hydra_main(config_path="conf", config_name="train_probe")
def main(cfg: DictConfig) -> None:
    paths = run_entry(train_probes, cfg, log=log)
    if paths is not None:
        log.info("%d result cells under %s", len(paths), cfg.results_dir)


if __name__ == "__main__":
    main()
