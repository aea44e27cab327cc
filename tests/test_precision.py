"""Precision policies: mixed precision trains within a stated tolerance of fp32; fp16 loss scaling skips a
step on every rank when one rank overflows; non-finite values stop (or skip) before the update."""

import importlib.util
import json
import math

import pytest
import torch

from conftest import SCRIPTS, run_cli
from disttrain.backend import NonFiniteError
from disttrain.config import load_config
from disttrain.trainer import Trainer

JOB = ["model.n_layer=2", "model.d_model=64", "model.seq_len=32", "data.global_batch_size=16", "train.steps=40",
       "train.eval_every=40", "train.eval_samples=64", "log.progress=false", "dist.threads_per_rank=1"]
# |eval loss - fp32 eval loss| after 40 steps. fp16 skips its first steps while the loss scale falls from
# 65536 to a value without overflow, so it trails fp32 a little.
TOLERANCE = {"bf16-mixed": 0.02, "bf16-true": 0.1, "fp16-mixed": 0.15}


# (dtype of the parameters, dtype of the logits the forward computes) under each policy
DTYPES = {"bf16-mixed": (torch.float32, torch.bfloat16), "bf16-true": (torch.bfloat16, torch.bfloat16),
          "fp16-mixed": (torch.float32, torch.float16)}


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    cfg = load_config(None, [*JOB, f"run.out_dir={tmp_path_factory.mktemp('fp32')}"])
    return Trainer(cfg).fit()


@pytest.mark.parametrize("precision", list(TOLERANCE))
def test_mixed_precision_trains_within_tolerance_of_fp32(precision, fp32, tmp_path):
    cfg = load_config(None, [*JOB, f"run.out_dir={tmp_path}", f"parallel.precision={precision}"])
    trainer = Trainer(cfg)
    result = trainer.fit()
    assert result.losses[-1] < result.losses[0] - 2.0
    assert abs(result.eval_losses[40] - fp32.eval_losses[40]) <= TOLERANCE[precision]
    # the policy was applied, not ignored: other numbers than fp32's, computed in the policy's dtypes
    assert max(abs(a - b) for a, b in zip(result.losses, fp32.losses, strict=True)) > 1e-4
    param_dtype, compute_dtype = DTYPES[precision]
    assert {p.dtype for p in trainer.backend.model.parameters()} == {param_dtype}
    logits = trainer.backend.forward(torch.zeros(2, 8, dtype=torch.long))
    assert logits.dtype == compute_dtype


# deepspeed (optional extra): the engine checks its own gradient partitions; disttrain's scaler drives the scale
STRATEGIES = ["ddp", "fsdp", "zero1"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inject")
    result = run_cli(["launch", "--fork", "--nproc", "2",
                      "--run-dir", str(tmp / "launch"), str(SCRIPTS / "inject_inf.py"),
                      str(tmp), *STRATEGIES], tmp, timeout=240)
    assert result.returncode == 0, result.stderr
    return tmp


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inf_on_one_rank_makes_every_rank_skip_and_halves_the_scale(injected, strategy):
    ranks = [json.loads((injected / f"{strategy}_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["records"] == ranks[1]["records"]  # every rank decided the same, every step
    records = {r["step"]: r for r in ranks[0]["records"]}
    step = ranks[0]["injected"]
    assert records[step]["skipped"] and not records[step]["changed"]  # parameters untouched on both ranks
    assert records[step]["scale"] == records[step - 1]["scale"] / 2
    assert not records[step + 1]["skipped"] and records[step + 1]["changed"]
    for rank in ranks:  # the scaler state survives a checkpoint save and load
        assert rank["restored_scale"] == records[step + 1]["scale"]
        assert rank["restored_skipped"] == sum(r["skipped"] for r in rank["records"])


class NaNAtStep(torch.nn.Module):
    """A regression model whose output becomes NaN on its 3rd training forward."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += self.training
        out = self.linear(x)
        return out * float("nan") if self.calls == 3 else out


def _nan_job(tmp_path, policy):
    x = torch.randn(64, 2)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "train.steps=5", "data.global_batch_size=8",
                             "data.micro_batch_size=8", f"train.on_nonfinite={policy}", "log.progress=false",
                             "train.eval_every=0", "dist.threads_per_rank=1", "optim.lr=0.1", "train.log_every=1"])
    model = NaNAtStep()
    trainer = Trainer(cfg, model=model, train_dataset=data,
                      loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]))
    return model, trainer


def test_nonfinite_loss_stops_before_the_update_naming_step_and_rank(tmp_path):
    model, trainer = _nan_job(tmp_path, "stop")
    with pytest.raises(NonFiniteError, match=r"step 3: the loss was non-finite on rank\(s\) 0"):
        trainer.fit()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_loss_with_skip_policy_is_skipped_and_counted(tmp_path):
    model, trainer = _nan_job(tmp_path, "skip")
    result = trainer.fit()
    assert len(result.losses) == 5 and math.isnan(result.losses[2])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    lines = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    assert [line["skipped_steps"] for line in lines] == [0, 0, 1, 1, 1]
