"""`python -m intervene model=... data=... cell=<cell.json>`: compose the config, steer along the cell's probe
direction and write its intervention file."""
from toolkit.entry import entry_main
from intervene.schema import InterveneSchema

main = entry_main("intervene", InterveneSchema, "intervene.run:run", lambda path, cfg: f"written: {path}",
                  quote=("cell",))   # a cell path holds =: cell=results/.../layer=16/seed=0.json as written

if __name__ == "__main__":
    main()
