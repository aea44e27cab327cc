"""README.md and docs/ (the guide has its own runner, test_guide.py) as written. Every command or Python block is
preceded by a marker line saying how the suite covers it:

    <!-- run -->                 executed here, verbatim, in a fresh folder holding a small `my.toml`
    <!-- tested-by: PATH ... -->  run with small settings by those test files: each `disttrain` subcommand of the
                                  block (bash), each name the block calls (Python) appears in one of them
    <!-- needs: WHAT -->          what the suite does not have (several machines, a GPU, a fresh clone)

A command block is one fenced as bash, sh or python, or an unfenced-language one whose lines are commands."""

import builtins
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if "guide" not in p.parts)]
FENCE = re.compile(r"(?:<!-- (run|tested-by|needs)(?::\s*(.*?))? -->\n)?```(\w*)\n(.*?)```", re.S)
COMMAND = re.compile(r"^(\.venv/bin/)?(disttrain|python3?|torchrun|make|bash|pip)\b")
MY_TOML = """[model]
n_layer = 1
d_model = 32
n_head = 2
seq_len = 16
[data]
global_batch_size = 32
micro_batch_size = 4
[train]
steps = 3
eval_every = 0
"""


def command_blocks(page: Path) -> list[tuple[str, str, str, str]]:
    """(marker, its argument, language, body) of each command block of `page`."""
    out = []
    for marker, argument, language, body in FENCE.findall(page.read_text()):
        lines = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if language in ("bash", "sh", "python") or (not language and lines and all(COMMAND.match(x) for x in lines)):
            out.append((marker, argument.strip(), language or "bash", body))
    return out


def _disttrain_api() -> set[str]:
    source = "\n".join(p.read_text() for p in (REPO / "src" / "disttrain").rglob("*.py"))
    return set(re.findall(r"^\s*(?:async )?(?:def|class) ([A-Za-z]\w*)", source, re.M))


API = _disttrain_api()


def called_names(language: str, body: str) -> set[str]:
    """What a block exercises: `disttrain` subcommands (bash), or the functions, classes and methods of disttrain
    it calls (Python: torch's calls and the reader's placeholders such as `MyModel` are not disttrain's)."""
    code = "\n".join(line.split("#")[0] for line in body.splitlines())
    if language == "python":
        return {n for n in re.findall(r"\b([A-Za-z_]\w*)\(", code) if n in API and not hasattr(builtins, n)}
    names = set()
    for match in re.finditer(r"disttrain (\w[\w-]*)(?: ([a-z][\w-]*))?", code):
        sub, second = match.groups()
        names.add(f"{sub} {second}" if sub in ("bench", "ckpt") and second else sub)
    return names


def test_every_command_block_says_how_the_suite_covers_it():
    seen = 0
    for page in PAGES:
        for marker, argument, _, body in command_blocks(page):
            seen += 1
            where = f"{page.relative_to(REPO)}: {body.splitlines()[0]!r}"
            assert marker, f"{where}: no <!-- run -->, <!-- tested-by: ... --> or <!-- needs: ... --> before it"
            assert marker == "run" or argument, f"{where}: <!-- {marker}: ... --> needs its argument"
    assert seen >= 15


def test_tested_by_names_tests_that_exercise_the_blocks_calls():
    for page in PAGES:
        for marker, argument, language, body in command_blocks(page):
            if marker != "tested-by":
                continue
            tests = argument.split()
            assert all((REPO / t).is_file() for t in tests), f"{page.name}: no such test file in {tests}"
            text = "\n".join((REPO / t).read_text() for t in tests)
            missing = sorted(n for n in called_names(language, body) if not exercised(n, text))
            assert not missing, f"{page.name}: {body.splitlines()[0]!r}: {missing} not exercised by {tests}"


def exercised(name: str, text: str) -> bool:
    """`name` (a call, a subcommand, or `bench X` / `ckpt X`) is used by the test source `text`: as a call or an
    argument, or (`bench X`) its module imported and run (`from disttrain.bench import X`)."""
    words = name.split()
    if re.search(r"[\"'\s.\[]" + r"[\"',\s]+".join(map(re.escape, words)) + r"\b", text):
        return True
    return len(words) == 2 and bool(re.search(rf"disttrain\.{words[0]} import [\w, ]*\b{re.escape(words[1])}\b"
                                              rf"|disttrain\.{words[0]}\.{re.escape(words[1])}\b", text))


def runnable(page: Path) -> list[tuple[str, str]]:
    return [(language, body) for marker, _, language, body in command_blocks(page) if marker == "run"]


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_the_runnable_blocks_run(page, tmp_path):
    (tmp_path / "my.toml").write_text(MY_TOML)
    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])  # the README's `.venv/bin/disttrain`
    env = {**cli_env(tmp_path), "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    for language, body in runnable(page):
        command = ["bash", "-euo", "pipefail", "-c", body] if language == "bash" else [sys.executable, "-c", body]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{page.name}:\n{body}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
