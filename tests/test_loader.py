"""The DataLoader path: the global stream through real worker processes, exact resume with num_workers = 2,
no worker left behind, datasets that are accepted (HF datasets.Dataset) and refused (no index)."""

import os
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from conftest import harness_processes
from disttrain.config import DataConfig, load_config
from disttrain.data import GlobalSampler, collate
from disttrain.errors import ConfigError
from disttrain.loader import Loaders, StepBatches
from disttrain.trainer import Trainer

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "data.global_batch_size=8",
        "data.micro_batch_size=4", "train.steps=6", "log.progress=false", "dist.threads_per_rank=1",
        "optim.warmup_steps=2"]


def children() -> list[int]:
    """Live (non-zombie) child processes of this test process (but the harness's): DataLoader workers would be among
    them."""
    found, harness = [], harness_processes()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and int(pid) not in harness:
            found.append(int(pid))
    return found


class Indexed(Dataset):
    """Items that carry their own index (as a scalar key, stacked by collate) next to a token window."""

    def __init__(self, n: int, fail_at: int = -1):
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i == self.fail_at:
            raise ValueError(f"item {i} is broken")
        ids = torch.arange(i, i + 5) % 256
        return {"input_ids": ids, "labels": ids, "index": i}


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_delivers_the_global_stream_on_any_world_size(workers):
    """Rank r of W, through a DataLoader with worker processes, gets exactly its slice of the world-size-free
    stream, from any cursor (here one that crosses an epoch boundary)."""
    dataset, sampler = Indexed(37), GlobalSampler(37, seed=3)
    cfg = DataConfig(num_workers=workers)
    cursor, steps, global_batch = 24, 3, 12
    delivered = {}
    with Loaders(cfg, collate, torch.device("cpu"), seed=0) as loaders:
        for world in (1, 2, 3):
            for rank in range(world):
                batches = StepBatches(sampler, cursor, steps, global_batch, 2, world, rank)
                delivered[world, rank] = [i for b in loaders.train(dataset, batches) for i in b["index"].tolist()]
                assert len(delivered[world, rank]) == steps * global_batch // world
    for world in (2, 3):
        per = global_batch // world
        for step in range(steps):
            stitched = [i for r in range(world) for i in delivered[world, r][step * per:(step + 1) * per]]
            assert stitched == delivered[1, 0][step * global_batch:(step + 1) * global_batch]
    assert delivered[1, 0] == sampler.global_indices(cursor, steps * global_batch)
    assert children() == []


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """6 steps straight with 0 and 2 workers; 3 steps + resume 3 with 2 workers (persistent eval workers)."""
    tmp = tmp_path_factory.mktemp("loader_resume")

    def fit(name, *extra):
        cfg = load_config(None, [*TINY, f"run.out_dir={tmp}", f"run.name={name}", "train.eval_every=3",
                                 "train.eval_samples=16", "checkpoint.every=3", *extra])
        result = Trainer(cfg).fit()
        assert children() == []  # every worker ended with the run
        return result

    straight0 = fit("w0")
    straight2 = fit("w2", "data.num_workers=2")
    workers = ["data.num_workers=2", "data.persistent_workers=true", "data.prefetch_factor=3"]
    first = fit("resumed", *workers, "train.stop_at=3")
    second = fit("resumed", *workers)
    return straight0, straight2, first, second


def test_workers_change_nothing_and_resume_is_bitwise(resume_runs):
    straight0, straight2, first, second = resume_runs
    assert straight2.losses == straight0.losses  # bitwise: workers only move where batches are built
    assert straight2.eval_losses == straight0.eval_losses
    assert len(first.losses) == 3 and len(second.losses) == 3
    assert first.losses + second.losses == straight2.losses  # bitwise after the kill/resume at step 3
    assert {**first.eval_losses, **second.eval_losses} == straight2.eval_losses


def test_workers_end_when_training_raises(tmp_path):
    """A dataset item that raises in a worker: the error names it, and no worker outlives the run."""
    cfg = load_config(None, [*TINY, f"run.out_dir={tmp_path}", "train.eval_every=0", "data.num_workers=2",
                             "data.shuffle=false"])
    with pytest.raises(ValueError, match="item 20 is broken") as info:
        Trainer(cfg, train_dataset=Indexed(64, fail_at=20)).fit()
    assert children() == [] and info.tb is not None  # even while the traceback (its frames) is alive

    def loss_fails_at_step_3(outputs, batch, calls=[]):  # noqa: B006 - a counter across calls
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("loss failed")
        return torch.nn.functional.cross_entropy(outputs.flatten(0, 1), batch["labels"].flatten())

    with pytest.raises(RuntimeError, match="loss failed") as info:
        Trainer(cfg, loss_fn=loss_fails_at_step_3, train_dataset=Indexed(64)).fit()
    assert children() == [] and info.tb is not None


def test_collate_fn_is_used_in_workers_and_its_config_error_is_one_line(tmp_path):
    cfg = load_config(None, [*TINY, f"run.out_dir={tmp_path}", "train.eval_every=2", "data.num_workers=2"])

    def fails_late(items):
        batch = collate(items)
        if any(item["index"] >= 60 for item in items):  # not in the first micro-batch that is probed
            raise ConfigError("collate: item too far; the fix")
        return batch

    trainer = Trainer(cfg, train_dataset=Indexed(64), collate_fn=fails_late)
    with pytest.raises(ConfigError) as info:
        trainer.fit()
    assert str(info.value) == "collate: item too far; the fix"  # not torch's multi-line wrapped copy
    assert children() == []


def test_hf_dataset_trains_with_workers(tmp_path):
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(4, 17, size=40)]
    hf = datasets.Dataset.from_dict({"input_ids": rows, "labels": [r[1:] + [-100] for r in rows]})
    cfg = load_config(None, [*TINY, f"run.out_dir={tmp_path}", "train.eval_every=3", "data.num_workers=2"])
    result = Trainer(cfg, train_dataset=hf, eval_dataset=hf.select(range(8))).fit()
    assert len(result.losses) == 6 and all(np.isfinite(result.losses)) and set(result.eval_losses) == {3, 6}
    assert children() == []


def _refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from ()

    hf = datasets.Dataset.from_dict({"input_ids": [[1, 2]]})
    return [Stream(), hf.to_iterable_dataset(), DataLoader([1, 2]), iter([1, 2])]


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("role", ["train_dataset", "eval_dataset"])
def test_datasets_without_an_index_are_refused_in_one_line(index, role, tmp_path):
    cfg = load_config(None, [*TINY, f"run.out_dir={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        Trainer(cfg, **{role: _refused()[index]})
    message = str(info.value)
    assert "\n" not in message and message.startswith(role) and "exact" in message and "materialise" in message
    assert not (tmp_path / "default").exists()


def test_labels_longer_than_inputs_are_refused_before_anything_starts(tmp_path):
    bad = [{"input_ids": [1, 2], "labels": [1, 2, 3]}] * 8
    cfg = load_config(None, [*TINY, f"run.out_dir={tmp_path}", "data.num_workers=2"])
    with pytest.raises(ConfigError) as info:
        Trainer(cfg, train_dataset=bad)
    assert "\n" not in str(info.value) and "3 labels for 2 input_ids" in str(info.value)
    assert "truncate the labels" in str(info.value)
    assert not (tmp_path / "default").exists() and children() == []


def test_two_ranks_with_workers_resume_on_one_rank_with_the_same_stream(tmp_path, small_gpt):
    """torchrun, 2 ranks x 2 workers, killed after step 3 (stop_at) and resumed on 1 rank: the same sample stream
    as a straight 1-rank run (within float tolerance: the reduction order differs across world sizes). The runs sit
    deep in the file system: the sockets through which the workers pass batches are named after the workers' temp
    folder, which stays the caller's (a run folder's would be longer than AF_UNIX allows)."""
    from conftest import read_metrics, run_cli

    out = tmp_path / ("nested-folder-" * 5)
    common = [*small_gpt, "--set", f"run.out_dir={out}", "--set", "train.steps=6", "--set", "train.eval_every=0",
              "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=2", "--set", "checkpoint.every=3"]
    for name, nproc, extra in (("straight", 1, []), ("elastic", 2, ["--set", "train.stop_at=3"]), ("elastic", 1, [])):
        result = run_cli(["train", "--nproc", str(nproc), "--set", f"run.name={name}", "--set", "data.num_workers=2",
                          *common, *extra], tmp_path)
        assert result.returncode == 0, result.stderr
    straight, elastic = (read_metrics(out / name) for name in ("straight", "elastic"))
    assert [m["step"] for m in elastic] == list(range(1, 7))
    assert [m["loss"] for m in elastic] == pytest.approx([m["loss"] for m in straight], abs=1e-5)
