"""MkDocs hooks (mkdocs.yml `hooks:`): what the pages show that the code already says.

- `<!-- options: NAME -->` becomes the table of entry point NAME's config groups and options, made from
  its schema (toolkit.entry.SCHEMAS; the lister of `--help`, toolkit.config) and the defaults of conf/NAME.yaml;
- `<!-- help: MODULE -->` becomes the `--help` of a plain argparse command (`MODULE.main(["--help"])`);
- `<!-- include: FILE NAME -->` becomes the block of FILE marked `<!-- NAME -->` ... `<!-- /NAME -->`;
- the committed figures (experiments/figures/*.png) are served as `figures/<name>.png`.
"""
from __future__ import annotations

import contextlib
import html
import importlib
import io
import re
import sys
from enum import Enum
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from toolkit.config import compose_config, group_choices, option_table  # noqa: E402
from toolkit.entry import schema_of  # noqa: E402

PLACEHOLDER = re.compile(r"<!-- (options|help|include): ([\w./ -]+?) -->")


def option_rows(name: str, cfg) -> list[tuple[str, str, str, str]]:
    """(option, type, default, description) of each option entry point `name` declares, as its --help lists
    them; `cfg` is conf/<name>.yaml composed with its hydra block (toolkit.config.compose_config)."""
    top = schema_of(name)
    return [(key, _type(f, top), "(required)" if default == "???" else default, f.metadata.get("help", ""))
            for key, f, default in option_table(cfg, top)]


def _type(f, top) -> str:
    """A field's type as written in its schema (`top`'s module names it); an enumeration as its choices."""
    hint = vars(sys.modules[top.__module__]).get(f.type) if isinstance(f.type, str) else f.type
    if isinstance(hint, type) and issubclass(hint, Enum):
        return " | ".join(hint.__members__)
    return getattr(f.type, "__name__", str(f.type))


def options_table(name: str) -> str:
    """The HTML tables of `name`'s config groups (choices, the default in bold) and options."""
    cfg = compose_config(name, hydra=True)
    out = ["<table><thead><tr><th>config group</th><th>choices (default in bold; conf/&lt;group&gt;/)</th>"
           "</tr></thead><tbody>"]
    for group, choice, names in group_choices(cfg):
        shown = ", ".join(f"<b>{n}</b>" if n == choice else n for n in names) + ("" if choice else " (default: none)")
        out.append(f"<tr><td><code>{group}=</code></td><td>{shown}</td></tr>")
    out += ["</tbody></table>", "",
            "<table><thead><tr><th>option</th><th>type</th><th>default</th><th>description</th></tr></thead><tbody>"]
    for key, kind, default, text in option_rows(name, cfg):
        out.append(f"<tr><td><code>{key}=</code></td><td>{html.escape(kind)}</td>"
                   f"<td><code>{html.escape(default)}</code></td><td>{html.escape(text)}</td></tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def argparse_help(module: str) -> str:
    """`python -m <module> --help` of a command with an argparse `main(argv)`."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        importlib.import_module(module).main(["--help"])
    return "```text\n" + text.getvalue().rstrip() + "\n```"


def marked_block(file: str, name: str) -> str:
    """The text of `file` (relative to the repository) between `<!-- name -->` and `<!-- /name -->`."""
    found = re.search(rf"<!-- {name} -->\n(.*?)<!-- /{name} -->", (ROOT / file).read_text(), re.S)
    if found is None:
        raise ValueError(f"{file} has no block marked <!-- {name} -->")
    return found.group(1)


def _replace(match: re.Match) -> str:
    kind, arg = match.groups()
    if kind == "options":
        return options_table(arg)
    if kind == "help":
        return argparse_help(arg)
    return marked_block(*arg.split())


def on_page_markdown(markdown: str, **_) -> str:
    return PLACEHOLDER.sub(_replace, markdown)


def on_files(files, config):
    for png in sorted((ROOT / "experiments" / "figures").glob("*.png")):
        files.append(File(f"figures/{png.name}", str(ROOT / "experiments"), config["site_dir"],
                          config["use_directory_urls"]))
    return files
