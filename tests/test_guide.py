"""docs/guide runs as written: every command block is marked either `# run` (executed here, in order per page, in a
fresh folder, as a user would paste it) or `# needs: ...` (what the suite does not have: several machines, a GPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs" / "guide").glob("*.md"))
BLOCK = re.compile(r"```(bash|python)\n(.*?)```", re.S)


def blocks(page: Path) -> list[tuple[str, str]]:
    return BLOCK.findall(page.read_text())


def test_every_block_says_whether_it_runs_here():
    assert len(PAGES) >= 6
    for page in PAGES:
        for language, body in blocks(page):
            first = body.splitlines()[0].strip()
            assert first == "# run" or first.startswith("# needs:"), f"{page.name}: unmarked {language} block: {first}"


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.startswith("# run") for _, b in blocks(p))],
                         ids=lambda p: p.name)
def test_the_runnable_blocks_run(page, tmp_path):
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    env = {**cli_env(tmp_path), "PYTHON": sys.executable,
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    for language, body in blocks(page):
        if not body.startswith("# run"):
            continue
        command = ["bash", "-euo", "pipefail", "-c", body] if language == "bash" else [sys.executable, "-c", body]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{page.name}:\n{body}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
