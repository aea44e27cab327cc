"""The Python API: your own model, datasets and loss, on 1 and 2 ranks."""

import json
import sys

import pytest

from conftest import SCRIPTS, run_alongside, run_cli
from disttrain.config import load_config
from disttrain.trainer import Trainer


@pytest.fixture(scope="module")
def mlp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlp")
    one, two = run_alongside([sys.executable, str(SCRIPTS / "mlp_job.py"), str(tmp / "one")], tmp,
                             lambda: run_cli(["launch", "--fork", "--nproc", "2", "--run-dir", str(tmp / "launch"),
                                              str(SCRIPTS / "mlp_job.py"), str(tmp / "two")], tmp), timeout=120)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    return [json.loads((tmp / name / "result.json").read_text()) for name in ("one", "two")]


def test_mlp_on_two_ranks_matches_one_process(mlp_results):
    one, two = mlp_results
    assert (one["world"], two["world"]) == (1, 2)
    assert len(one["losses"]) == 15
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert one["losses"][-1] < 0.5 * one["losses"][0]  # it learns
    assert two["eval_losses"].keys() == one["eval_losses"].keys() == {"5", "10", "15"}
    for step in one["eval_losses"]:
        assert two["eval_losses"][step] == pytest.approx(one["eval_losses"][step], abs=1e-5)


def test_eval_counts_each_validation_sample_once(mlp_results):
    for result in mlp_results:  # 13 samples, micro-batch 2, on 1 and 2 ranks
        assert result["id_count"] == 13
        assert result["id_sum"] == pytest.approx(sum(range(13)))


def test_same_seed_same_run_and_another_seed_differs(tmp_path):
    def losses(seed):
        cfg = load_config(None, [f"run.out_dir={tmp_path}", f"run.seed={seed}", "train.steps=4",
                                 "model.n_layer=1", "model.d_model=32", "model.seq_len=16", "train.eval_every=0",
                                 "log.progress=false", "dist.threads_per_rank=1"])
        return Trainer(cfg).fit().losses

    first = losses(0)
    assert losses(0) == first  # bitwise
    assert losses(1) != first


def test_a_training_step_reads_the_device_once_after_queuing_its_update(tmp_path, monkeypatch):
    """Reading a tensor back (`.item()`, `.tolist()`, `bool()`, `float()`, `int()`, `.numpy()`) makes a GPU's host
    wait for the work queued before it. The Trainer's step reads the device once, after the optimizer's update is
    queued (the step's totals, gradient norm and outcome together, as a hand-written loop's `loss.item()`): not each
    micro-batch's loss and count, nor the totals and the norm before the update. Counted as the reads of 5 steps minus
    those of 3, so set-up and the end of the run cancel out; 4 micro-batches per step."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    events: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            events.append("read")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    handle = register_optimizer_step_post_hook(lambda *_: events.append("update"))

    def run(steps: int) -> list[str]:
        cfg = load_config(None, [f"run.out_dir={tmp_path / str(steps)}", f"train.steps={steps}", "model.n_layer=1",
                                 "model.d_model=32", "model.seq_len=16", "data.global_batch_size=8",
                                 "data.micro_batch_size=2", "train.eval_every=0", "log.progress=false",
                                 "dist.threads_per_rank=1"])
        before = len(events)
        Trainer(cfg).fit()
        return events[before:]

    try:
        five, three = run(5), run(3)
    finally:
        handle.remove()
    assert (five.count("read") - three.count("read")) / 2 == 1
    updates = [i for i, e in enumerate(five) if e == "update"]
    assert len(updates) == 5
    for k in (1, 2, 3):  # a middle step's one read lies between its update and the next step's
        assert five[updates[k] + 1:updates[k + 1]].count("read") == 1
        assert five[updates[k] + 1] == "read"


@pytest.mark.parametrize("policy", ["abort", "continue"])
def test_checkpoint_on_error_policy_with_a_full_disk(policy, tiny_disk, caplog):
    import logging

    from disttrain.checkpoint import CheckpointError

    cfg = load_config(None, [f"run.out_dir={tiny_disk}", "train.steps=4", "checkpoint.every=2",
                             f"checkpoint.on_error={policy}", "train.eval_every=0", "log.progress=false",
                             "dist.threads_per_rank=1", "model.n_layer=2", "model.d_model=64"])  # ~3 MB state
    if policy == "abort":
        with pytest.raises(CheckpointError, match="No space left on device"):
            Trainer(cfg).fit()
    else:
        with caplog.at_level(logging.WARNING):
            assert len(Trainer(cfg).fit().losses) == 4
        assert "training continues" in caplog.text and "No space left on device" in caplog.text
    assert not list((tiny_disk / "default" / "checkpoints").glob("step_*"))
