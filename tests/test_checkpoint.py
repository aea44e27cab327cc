"""CheckpointManager on its own (no trainer): layout, retention, corruption, full disk, async, no pickle."""

import hashlib
import json
import logging
import math
import pickle
import sys
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, run_cli
from disttrain.checkpoint import COMMIT, LATEST, MANIFEST, CheckpointError, CheckpointManager
from disttrain.checkpoint.statefile import ChecksumError
from disttrain.cli import main
from disttrain.config import CheckpointConfig

sys.path.insert(0, str(SCRIPTS))
from planted_shard import fsdp_gpt, plant_pickle, train_step  # noqa: E402


def _state(seed: int = 0, size: int = 1000) -> dict:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(8, 4, generator=g)
    return {
        "model": {"emb.weight": shared, "head.weight": shared, "big": torch.randn(size, generator=g)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, generator=g)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]},
        "step": seed, "note": None, "nan": float("nan"),
    }


def test_round_trip_layout_and_commit_marker(tmp_path):
    manager = CheckpointManager(tmp_path, info={"strategy": "single", "config_hash": "abc"})
    manager.save(7, _state(7), metrics={"eval_loss": 1.5})
    folder = tmp_path / "step_7"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [COMMIT, MANIFEST, "state.json", "state.safetensors", "rank0.json", "rank0.safetensors"])
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1 and manifest["strategy"] == "single"
    assert manifest["metrics"] == {"eval_loss": 1.5} and manifest["torch"] == torch.__version__
    assert set(manifest["files"]) == {"state.json", "state.safetensors", "rank0.json", "rank0.safetensors"}
    assert (tmp_path / LATEST).read_text() == "step_7"

    loaded = manager.load()
    original = _state(7)
    assert loaded["step"] == 7 and loaded["note"] is None and math.isnan(loaded["nan"])
    assert loaded["model"]["emb.weight"] is loaded["model"]["head.weight"]  # tied weights stay tied
    torch.testing.assert_close(loaded["model"]["big"], original["model"]["big"], rtol=0, atol=0)
    assert loaded["optimizer"]["state"][0]["step"].item() == 3.0  # int keys and tuples come back as such
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert set(loaded["rank_state"]["rng"]) >= {"python", "numpy", "torch"}


def test_retention_keep_last_and_best_with_a_nan_in_the_middle(tmp_path):
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=2, keep_best=1))
    for step, value in zip(range(1, 7), [5.0, 3.0, float("nan"), 3.0, 6.0, 7.0], strict=True):
        manager.save(step, _state(step, size=10), metrics={"eval_loss": value})
    # last two (5, 6) plus the best: 3.0 at steps 2 and 4, a tie that goes to the earlier step
    assert manager.list() == [2, 5, 6]
    assert manager.best() == 2 and manager.latest() == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_2", "step_5", "step_6"]


def test_best_by_max_and_missing_metric_is_never_best(tmp_path):
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=5, best_metric="acc", best_mode="max"))
    manager.save(1, _state(1, 10), metrics={"acc": 0.5})
    manager.save(2, _state(2, 10), metrics={})
    manager.save(3, _state(3, 10), metrics={"acc": float("nan")})
    assert manager.best() == 1


def test_discovery_scans_for_commits_and_cleans_leftovers(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1, 10))
    (tmp_path / "step_9").mkdir()  # an interrupted save: files but no commit marker
    (tmp_path / "step_9" / "state.safetensors").write_bytes(b"partial")
    (tmp_path / LATEST).write_text("step_9")  # even a lying `latest` is not trusted
    assert manager.list() == [1] and manager.load()["step"] == 1
    manager.save(2, _state(2, 10))
    assert not (tmp_path / "step_9").exists()


def _newest_two(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    return manager, tmp_path / "step_2"


@pytest.mark.parametrize("manifest", ["{not json", '{"files": {"a": 5}, "time": "t", "world_size": 1}', "[]"])
def test_a_damaged_manifest_is_a_row_of_ckpt_list_and_bad_in_ckpt_verify(manifest, tmp_path, capsys):
    _newest_two(tmp_path)
    (tmp_path / "step_2" / MANIFEST).write_text(manifest)
    assert main(["ckpt", "list", str(tmp_path)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[:2] == ["1", "committed"] and rows[2].split()[:2] == ["2", "damaged"], rows
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    assert "step_2: BAD" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(tmp_path / "step_9")]) == 2  # not there: a mistake, not a damaged save
    assert capsys.readouterr().err.strip().startswith(f"disttrain: error: '{tmp_path / 'step_9'}' does not exist")


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: _flip_byte(d / "state.safetensors"), "sha256 does not match"),
    (lambda d: (d / "state.safetensors").write_bytes((d / "state.safetensors").read_bytes()[:100]), "truncated"),
    (lambda d: (d / "rank0.json").unlink(), "missing"),
    (lambda d: (d / MANIFEST).write_text((d / MANIFEST).read_text().replace('"step": 2', '"step": 3')),
     "does not match the commit marker"),
])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(damage, reason, tmp_path, caplog, capsys):
    manager, newest = _newest_two(tmp_path)
    damage(newest)
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "step_1: ok" in out and "step_2: BAD" in out and reason in out
    with caplog.at_level(logging.WARNING, logger="disttrain.checkpoint"):
        assert manager.load()["step"] == 1
    assert "skipping checkpoint step 2" in caplog.text and reason in caplog.text
    with pytest.raises(CheckpointError, match="step 2 is not valid"):
        manager.load(2)


def test_no_valid_checkpoint_left_fails_clearly(tmp_path):
    manager, newest = _newest_two(tmp_path)
    _flip_byte(newest / "state.safetensors")
    _flip_byte(tmp_path / "step_1" / "state.safetensors")
    with pytest.raises(CheckpointError, match="no valid checkpoint to load"):
        manager.load()


def test_full_disk_fails_the_save_cleanly_and_keeps_earlier_checkpoints(tiny_disk):
    manager = CheckpointManager(tiny_disk)
    manager.save(1, _state(1, size=10_000))  # ~40 KB: fits
    with pytest.raises(CheckpointError) as info:
        manager.save(2, _state(2, size=400_000))  # ~1.6 MB: does not
    message = str(info.value)
    assert str(tiny_disk / "step_2") in message and "No space left on device" in message and "MiB free" in message
    assert manager.list() == [1] and not (tiny_disk / "step_2").exists()
    assert manager.load()["step"] == 1


def test_async_save_snapshots_the_state_and_surfaces_errors_later(tiny_disk):
    manager = CheckpointManager(tiny_disk, CheckpointConfig(async_save=True))
    state = _state(1, size=10_000)
    expected = state["model"]["big"].clone()
    manager.save(1, state)
    state["model"]["big"].add_(1.0)  # training goes on mutating the live tensors
    manager.wait()
    torch.testing.assert_close(manager.load()["model"]["big"], expected, rtol=0, atol=0)

    manager.save(2, _state(2, size=400_000))  # returns at once; the write fails in the background
    with pytest.raises(CheckpointError, match="No space left on device"):
        manager.save(3, _state(3, size=10))  # the error surfaces at the next save
    assert manager.list() == [1]  # the failed checkpoint was never committed
    manager.save(3, _state(3, size=10))
    manager.wait()
    assert manager.list() == [1, 3]


def test_a_large_state_is_split_over_files_written_and_verified_in_parallel(tmp_path, monkeypatch, caplog):
    from disttrain.checkpoint import statefile

    monkeypatch.setattr(statefile, "PART_BYTES", 5000)  # parts of ~5 KB here (the 16 KB tensor is one part)
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, _state(step, size=4000))
    parts = sorted(p.name for p in (tmp_path / "step_2").glob("state*.safetensors"))
    assert parts == [f"state-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    loaded, original = manager.load(2), _state(2, size=4000)
    torch.testing.assert_close(loaded["model"]["big"], original["model"]["big"], rtol=0, atol=0)
    assert loaded["model"]["emb.weight"] is loaded["model"]["head.weight"]  # tied, stored once
    _flip_byte(tmp_path / "step_2" / parts[1])
    with caplog.at_level(logging.WARNING):
        assert manager.load()["step"] == 1  # the damaged part is named; the previous checkpoint loads
    assert parts[1] in caplog.text and "sha256" in caplog.text


def test_deferred_copy_holds_the_state_of_save_time_once_wait_for_copy_returns(tmp_path):
    manager = CheckpointManager(tmp_path, CheckpointConfig(async_save=True))
    for step in (1, 2):  # the second save copies into the staging buffers of the first
        state = _state(step, size=2_000_000)
        expected = state["model"]["big"].clone()
        manager.save(step, state, defer_copy=True)  # returns before the copy is taken
        manager.wait_for_copy()  # what the Trainer waits for before an optimizer step
        state["model"]["big"].mul_(-3.0)
        manager.wait()
        torch.testing.assert_close(manager.load(step)["model"]["big"], expected, rtol=0, atol=0)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on the load path")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert manager.load()["step"] == 1


def test_one_bit_in_a_large_file_is_caught(tmp_path):
    n = 20 * 2**20 // 4  # 20 MiB
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"big": torch.arange(n, dtype=torch.int32)})
    manager.save(2, {"big": torch.arange(n, dtype=torch.int32) + 1})
    assert manager.load()["big"][-1].item() == n  # the last element of step 2
    path = tmp_path / "step_2" / "state.safetensors"
    data = bytearray(path.read_bytes())
    data[15 * 2**20 + 123] ^= 0x01  # one bit, deep inside
    path.write_bytes(bytes(data))
    assert manager.load()["big"][-1].item() == n - 1  # fell back to step 1


def test_ranks_loading_together_share_the_files_none_of_them_reads(tmp_path):
    """Each of n ranks hashes the files it reads and every n-th of the rest: a damaged file outside every rank's
    reads is found by exactly one of them, and a file a rank reads is always checked by that rank."""
    from disttrain.checkpoint import read_checkpoint_files

    CheckpointManager(tmp_path).save(1, _state(), rank_state={"x": torch.ones(3)})
    path = tmp_path / "step_1"
    (path / "rank1.json").write_text("{}")  # another rank's files, as a 2-rank save leaves them
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["rank1.json"] = {"size": 2, "sha256": "0" * 64}  # damaged: its sha256 cannot match
    manifest_bytes = json.dumps(manifest).encode()
    (path / MANIFEST).write_bytes(manifest_bytes)
    (path / COMMIT).write_text(hashlib.sha256(manifest_bytes).hexdigest())

    def reads(name):
        return name.startswith(("state", "rank0."))
    outcomes = []
    for share in [(0, 2), (1, 2)]:
        try:
            _, blobs = read_checkpoint_files(path, reads, share)
            outcomes.append(sorted(blobs))
        except ChecksumError as exc:
            outcomes.append(str(exc))
    found = [o for o in outcomes if isinstance(o, str)]
    assert len(found) == 1 and "rank1.json: sha256 does not match" in found[0]
    assert ["rank0.json", "rank0.safetensors", "state.json", "state.safetensors"] in outcomes  # only what it reads
    with pytest.raises(ChecksumError, match="rank1.json"):
        read_checkpoint_files(path, lambda name: name.startswith("rank1."), (1, 2))  # what a rank reads: checked


def test_files_interoperate_with_the_safetensors_library(tmp_path):
    from safetensors.torch import load_file, save_file

    from disttrain.checkpoint.statefile import load_safetensors, write_safetensors

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int16),
               "c": torch.ones(2, dtype=torch.bfloat16),
               "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5, dtype=torch.float64)}
    write_safetensors(tmp_path / "ours.safetensors", tensors)
    theirs = load_file(tmp_path / "ours.safetensors")
    save_file(tensors, tmp_path / "theirs.safetensors")
    buf = torch.frombuffer(bytearray((tmp_path / "theirs.safetensors").read_bytes()), dtype=torch.uint8)
    ours = load_safetensors(buf)
    for loaded in (theirs, ours):
        assert loaded.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


def test_rng_states_round_trip(tmp_path):
    import random

    import numpy as np

    from disttrain.checkpoint import restore_rng

    manager = CheckpointManager(tmp_path)
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    manager.save(1, {"x": torch.zeros(1)})  # the RNG states go into this rank's file
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    restore_rng(manager.load()["rank_state"]["rng"])
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


@pytest.fixture
def one_rank_group():
    """A real one-process gloo group (in-memory store), destroyed afterwards."""
    import torch.distributed as dist

    from disttrain.config import DistConfig
    from disttrain.runtime import init_runtime, shutdown

    runtime = init_runtime(DistConfig(device="cpu", threads_per_rank=1), environ={}, always_form_group=True)
    yield runtime
    shutdown(runtime)
    assert not dist.is_initialized()


def test_sharded_state_goes_through_dcp_with_json_metadata_and_no_pickle(tmp_path, one_rank_group, monkeypatch):
    def build():
        return fsdp_gpt(one_rank_group)

    backend = build()
    train_step(backend)
    manager = CheckpointManager(tmp_path, runtime=one_rank_group)
    manager.save(1, backend.state_dict())
    folder = tmp_path / "step_1"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["layout"] == "dcp" and "__0_0.distcp" in manifest["files"] and "metadata.json" in manifest["files"]
    assert not (folder / ".metadata").exists()  # DCP's pickled metadata is replaced by JSON

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on the load path")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    restored = build()
    restored.load_state_dict(manager.load(target=restored.prepared.checkpoint_target))
    for a, b in zip(backend.model.parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor())
    full = CheckpointManager(tmp_path).load(1)  # without a target: full tensors, e.g. for export
    assert torch.equal(full["model"]["tok_emb.weight"], backend.model.tok_emb.weight.full_tensor())


def test_async_sharded_saves_are_synchronous_where_a_gloo_group_would_not_reach_every_node(
        tmp_path, one_rank_group, monkeypatch, caplog):
    """Async sharded saves run DCP on a gloo group of their own; where gloo would give the other nodes a loopback
    address (runtime.loopback_gloo, stood in for here: this machine is one node) the ranks agree to save
    synchronously instead, with a warning, and a full-layout save stays asynchronous."""
    from disttrain.checkpoint import manager as manager_module

    monkeypatch.setattr(manager_module, "loopback_gloo", lambda world, local: "this host's name resolves to loopback")
    backend = fsdp_gpt(one_rank_group)
    train_step(backend)
    manager = CheckpointManager(tmp_path, CheckpointConfig(async_save=True), runtime=one_rank_group)
    with caplog.at_level(logging.WARNING, logger="disttrain.checkpoint.manager"):
        manager.save(1, backend.state_dict())
    assert manager._pending is None and (tmp_path / "step_1" / COMMIT).exists()  # written before save returned
    assert "saving synchronously" in caplog.text and manager._dcp_group is False
    manager.save(2, {"model": {"w": torch.ones(3)}})  # a full layout: no gloo group, still in the background
    assert manager._pending is not None
    manager.wait()
    assert manager.list() == [1, 2]


def test_a_pickle_planted_in_a_dcp_shard_is_refused_and_loading_falls_back(tmp_path, one_rank_group, caplog):
    """The shard's sha256 and the commit marker are forged to match, so it is the loader (DCP's
    `torch.load(weights_only=True)`) that refuses the file: a damaged checkpoint, skipped like any other."""
    backend = fsdp_gpt(one_rank_group)
    manager = CheckpointManager(tmp_path, runtime=one_rank_group)
    train_step(backend)
    manager.save(1, backend.state_dict())
    step1 = [p.full_tensor().clone() for p in backend.model.parameters()]
    train_step(backend)
    manager.save(2, backend.state_dict())
    marker, shard = tmp_path / "pwned", tmp_path / "step_2" / "__0_0.distcp"
    plant_pickle(shard.parent, shard.name, marker)
    assert main(["ckpt", "verify", str(tmp_path)]) == 0  # the forgery passes every checksum

    restored = fsdp_gpt(one_rank_group)
    with caplog.at_level(logging.WARNING, logger="disttrain.checkpoint"):
        loaded = manager.load(target=restored.prepared.checkpoint_target)
    assert not marker.exists()  # nothing was unpickled
    assert loaded["manifest"]["step"] == 1
    assert "skipping checkpoint step 2" in caplog.text and str(shard) in caplog.text
    assert "refused by torch.load(weights_only=True)" in caplog.text and "GLOBAL posix.system" in caplog.text
    restored.load_state_dict(loaded)
    for expected, param in zip(step1, restored.model.parameters(), strict=True):
        assert torch.equal(param.full_tensor(), expected)
    with pytest.raises(CheckpointError, match=r"step 2 is not valid: .*__0_0\.distcp: refused"):
        manager.load(2, target=restored.prepared.checkpoint_target)
    assert not marker.exists()


def test_a_pickle_planted_in_one_ranks_shard_makes_every_rank_fall_back(tmp_path):
    """Two real ranks; only rank 1's shard is planted. DCP gathers the refusal, so both ranks skip step 2. Step 3
    has a flipped byte in a file only rank 1 hashes: the ranks agree, and skip it too."""
    result = run_cli(["launch", "--fork", "--nproc", "2", "--run-dir", str(tmp_path / "launch"),
                      str(SCRIPTS / "planted_shard.py"), str(tmp_path)], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in ranks] == [1, 1] and all(r["same_as_step1"] for r in ranks)
    assert not (tmp_path / "pwned").exists()
    flipped, planted = ranks[0]["warnings"]
    assert flipped.startswith("skipping checkpoint step 3: ") and "__1_0.distcp: sha256 does not match" in flipped
    assert flipped.endswith("(found by rank 1)")  # rank 0 did not hash that file: the ranks share DCP's files
    assert planted.startswith("skipping checkpoint step 2: ") and "__1_0.distcp: refused" in planted
