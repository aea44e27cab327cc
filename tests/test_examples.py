"""The examples a user copies run as documented (small settings)."""

import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import cli_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_finetune_hf_example_learns_exports_and_generates(tmp_path):
    """examples/finetune_hf.py: local tokenizer and Llama, fsdp on 2 ranks, the loss falls, the HF export loads in
    transformers and generates."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "finetune_hf.py"), "--nproc", "2", "--steps", "30",
                           "--out", str(tmp_path)], cwd=tmp_path, env=cli_env(tmp_path), capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < first - 1.0, proc.stdout
    generated = re.search(r"generated: (.*)", proc.stdout).group(1)
    assert len(generated.split()) > 5
    assert (tmp_path / "finetune_hf_export" / "config.json").is_file()
    assert list(tmp_path.glob("finetune_hf_assets/docs.jsonl.*.tokens.npy"))  # tokenised once, cached


def test_grpo_example_syncs_weights_to_its_inference_worker_and_the_reward_rises(tmp_path):
    """examples/grpo_hf.py: fsdp on 2 ranks trains a tiny Llama; a forked inference worker rolls out with each version
    it receives through the weight sync. Run as a user would, without OMP_NUM_THREADS: numpy's thread pool is
    there, and forking the inference worker is still allowed."""
    env = {k: v for k, v in cli_env(tmp_path).items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "grpo_hf.py"), "--iters", "16"], cwd=EXAMPLES, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["versions"] == list(range(1, 17))  # every rollout after a new version
    assert result["last_reward"] > result["first_reward"] + 0.15, result
