"""`python -m zero_shot model=... data=... [enumeration=...] [scores=...]`: compose the config, score the
statements (or load saved scores) and write the zero-shot result cells."""
from toolkit.entry import entry_main
from zero_shot.schema import ZeroShotSchema

main = entry_main("zero_shot", ZeroShotSchema, "zero_shot.run:run",
                  lambda paths, cfg: f"{len(paths)} files under {cfg.results_dir}")

if __name__ == "__main__":
    main()
