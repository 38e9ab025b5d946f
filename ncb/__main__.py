"""`python -m ncb model=... data=... method=<cell.json|zero_shot>`: compose the config, compute the targets'
NCB and the stress tests of one method."""
from extract.config import answer_help
from ncb.schema import NCBSchema

answer_help(__name__, "ncb", NCBSchema)   # before the imports below: --help needs no torch

import logging

from omegaconf import DictConfig

from extract.errors import hydra_main, run_entry
from ncb.run import run

log = logging.getLogger("ncb")


@hydra_main(config_path="../conf", config_name="ncb")
def main(cfg: DictConfig) -> None:
    paths = run_entry(run, cfg, log=log)
    if paths is not None:
        log.info("written: %s", ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
