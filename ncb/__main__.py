"""`python -m ncb model=... data=... method=<cell.json|zero_shot>`: compose the config, compute the targets'
NCB and the stress tests of one method."""
from toolkit.entry import entry_main
from ncb.schema import NCBSchema

main = entry_main("ncb", NCBSchema, "ncb.run:run", lambda paths, cfg: f"written: {', '.join(map(str, paths))}",
                  quote=("method",))   # a cell path holds =: method=results/.../layer=16/seed=0.json as written

if __name__ == "__main__":
    main()
