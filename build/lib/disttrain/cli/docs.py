"""Generate `docs/config.md` (every setting, its type, default and meaning) from the config source."""

from __future__ import annotations

import sys

from disttrain.config import describe


def config_reference() -> str:
    lines = ["# Configuration reference", "",
             "Generated from `src/disttrain/config/sections.py` by `python -m disttrain.cli.docs > docs/config.md`;",
             "a test fails when it is out of date. Set any key in a TOML file (`[section]` then `key = value`)",
             "or on the command line with `--set section.key=value`.", ""]
    section = None
    for key, typ, default, doc in describe():
        head = key.split(".")[0]
        if head != section:
            section = head
            lines += ["", f"## [{section}]", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        lines.append(f"| `{key}` | {typ} | `{default!r}` | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(config_reference())
