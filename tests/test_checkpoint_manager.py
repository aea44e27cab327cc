"""The CheckpointManager used directly, in the words of ../shared/seeds/004, on real ranks."""

import json

from conftest import SCRIPTS, run_cli


def test_the_design_documents_words_on_two_sharded_ranks(tmp_path):
    """save_checkpoint / load_latest_checkpoint / load_best_checkpoint (../shared/seeds/004) under FSDP2 on 2 ranks:
    the best survives rotation, loads give back the saved values, a save or load waits for rank 0's slow async
    write of the previous one longer than arrival_timeout_s, a full disk on one rank fails the save on both (sync and
    async) without a hang, a rank that comes after another gave up on it stops too (one settled outcome), and rank 0
    calling alone fails fast."""
    result = run_cli(["launch", "--fork", "--nproc", "2",
                      "--run-dir", str(tmp_path / "run"), str(SCRIPTS / "ckpt_words.py"),
                      str(tmp_path / "ckpt"), str(tmp_path / "out.json")], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["empty"] is None
    assert out["kept"] == [2, 4, 5]  # keep_last = 2, and the checkpoint saved with is_best
    assert out["latest"] == {"step": 5, "equal": True, "moments": True}
    assert out["best"] == {"step": 2, "equal": True}
    assert out["calls"] >= 7 and out["check_ins"] == [out["calls"]]  # the store keeps the last check-in's keys only
    for rank in range(2):
        assert json.loads((tmp_path / f"slow{rank}.json").read_text()) == [1.0, 2.0, 3.0, 4.0]
    for mode in ("sync", "async"):  # rank 1's disk full during an FSDP save: both ranks fail it, none hangs
        full = [json.loads((tmp_path / f"full_{mode}{rank}.json").read_text()) for rank in range(2)]
        assert [f["kept"] for f in full] == [[1], [1]], full
        assert "another rank failed to write" in full[0]["outcome"], full
        assert "No space left on device" in full[1]["outcome"] and "are untouched" in full[1]["outcome"], full
    for what in ("folder", "commit", "commit_async"):  # what rank 0 alone does (create, commit) fails on both
        blocked = [json.loads((tmp_path / f"blocked_{what}{rank}.json").read_text()) for rank in range(2)]
        assert [b["kept"] for b in blocked] == [[], []], blocked
        assert "cannot write checkpoint" in blocked[0]["outcome"], blocked
        assert ("rank 0 could not create the folder" if what == "folder" else "another rank") in \
            blocked[1]["outcome"], blocked
    late = [json.loads((tmp_path / f"late{rank}.json").read_text()) for rank in range(2)]  # one outcome, settled
    assert [lt["kept"] for lt in late] == [[1], [1]], late
    assert [lt["check_ins"] for lt in late] == [[3], [3]], late  # a failed check-in's keys go at the next that settles
    assert late[0]["outcome"].startswith("ArrivalError") and "rank 0 waited 1 s for rank(s) 1" in late[0]["outcome"]
    assert late[1]["outcome"].startswith("ArrivalError") and "rank 1 came to it after rank 0" in late[1]["outcome"]
    assert "collective" in out["lonely"] and "rank(s) 1" in out["lonely"] and "if rank == 0" in out["lonely"]
    assert out["lonely_s"] < 10
