"""`python -m train_probe probe=... task=... layer=...`: compose the config, train, write result cells."""
from extract.entry import entry_main
from probes.schema import TrainProbeSchema

main = entry_main("train_probe", TrainProbeSchema, "probes.pipeline:train_probes",
                  lambda paths, cfg: f"{len(paths)} result cells under {cfg.results_dir}")

if __name__ == "__main__":
    main()
