"""Packaging truths: the torch floor is the release CI runs, `make run` installs no test or optional packages, the
license ships, and `disttrain env` says what a bug report needs."""

import re
from pathlib import Path

import tomllib

from disttrain.cli.env import env_report

REPO = Path(__file__).resolve().parents[1]


def test_the_torch_floor_is_the_release_the_suite_runs_on():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floor = next(d for d in project["dependencies"] if d.startswith("torch"))
    pin = re.search(r"TORCH_PIN \?= torch==([\d.]+)", (REPO / "Makefile").read_text()).group(1)
    assert floor == f"torch>={'.'.join(pin.split('.')[:2])}", (floor, pin)
    import torch

    assert torch.__version__.startswith(pin)  # this suite runs on it


def test_make_run_installs_only_what_the_default_job_needs_and_the_license_ships():
    makefile = (REPO / "Makefile").read_text()
    run_install = re.search(r"\.installed-run:.*?touch", makefile, re.S).group(0)
    assert '-e .\n' in run_install and "[dev]" not in run_install
    assert re.search(r"^run: \$\(VENV\)/\.installed-run$", makefile, re.M)
    assert re.search(r"^test: \$\(VENV\)/\.installed-dev$", makefile, re.M)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(name in " ".join(project["dependencies"]) for name in ("pytest", "ray", "deepspeed", "transformers"))
    assert "Apache License" in (REPO / "LICENSE").read_text() and project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]  # (an SPDX expression and its file, PEP 639)


def test_env_reports_nccl_the_extras_and_the_relevant_variables(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("DISTTRAIN_DIST_NPROC", "2")
    report = env_report()
    assert report["nccl"]  # a version, or that this build has none
    assert re.search(r"transformers \d", report["optional extras"]) and "PyYAML" in report["optional extras"]
    assert "NCCL_SOCKET_IFNAME=eth0" in report["environment"] and "DISTTRAIN_DIST_NPROC=2" in report["environment"]
