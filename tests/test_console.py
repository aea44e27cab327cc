"""The launcher's terminal under `--nproc 2`: one live progress bar, drawn in place from rank 0's progress, with the
workers' lines printed above it (never torn), an h:mm:ss ETA and a total that honours `train.stop_at`; checked
through a pseudo-terminal, as a user sees it."""

import os
import pty
import re

from conftest import DISTTRAIN, cli_env


def run_in_terminal(args: list[str], cwd, env) -> tuple[int, str]:
    pid, fd = pty.fork()
    if pid == 0:  # the child: disttrain with the pseudo-terminal as its terminal
        os.chdir(cwd)
        os.execvpe(DISTTRAIN[0], DISTTRAIN + args, env)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")


def test_one_live_bar_on_a_terminal_with_worker_lines_above_it(tmp_path):
    code, out = run_in_terminal(
        ["train", "--nproc", "2", "--set", f"run.out_dir={tmp_path}", "--set", "run.name=live", "--set",
         "train.steps=40", "--set", "train.stop_at=24", "--set", "checkpoint.every=8", "--set", "model.n_layer=1",
         "--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "train.eval_every=8"], tmp_path,
        cli_env(tmp_path))
    assert code == 0, out[-3000:]
    out = out.replace("\r\n", "\n")  # the terminal's newline
    redraws = re.findall(r"\r\[[#.]{30}\] (\d+)/(\d+) ", out)
    assert len(redraws) >= 3 and {total for _, total in redraws} == {"24"}  # the total honours stop_at
    assert redraws[-1][0] == "24" and re.search(r"eta \d:\d\d:\d\d", out)
    # the workers' lines arrive, each on a line of its own: after the bar is cleared, or at a line's start
    assert "[rank 0] disttrain: checkpoint step 8 committed" in out and "[rank 0] disttrain: done: steps 1-24" in out
    for match in re.finditer(r"\[rank \d\] ", out):
        before = out[:match.start()]
        assert before.endswith("\x1b[K") or before.endswith("\n") or not before, repr(before[-80:])
    # one bar: the workers draw none, and the bar's text ends up on one terminal line, not twenty
    assert not re.search(r"\[rank \d\] \[[#.]{30}\]", out)
    finished = [line for line in out.split("\n") if re.search(r"\[[#.]{30}\] \d+/24", line.split("\r")[-1])]
    assert len(finished) == 1, finished


def test_a_reused_run_folder_shows_only_this_launchs_lines_and_steps(tmp_path):
    """The logs and metrics an earlier launch left in the run folder are not replayed: only what the workers of
    this launch write (a new attempt folder; metrics.jsonl rewritten by rank 0)."""
    import io
    import json
    import os

    from disttrain.console import Console

    old_log = tmp_path / "logs" / "old_run" / "attempt_0" / "0" / "stderr.log"
    old_log.parent.mkdir(parents=True)
    old_log.write_text("disttrain: done: the earlier run\n")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3)))
    out, err = io.StringIO(), io.StringIO()
    console = Console(tmp_path / "logs", metrics, total=3, out=out, err=err)
    console.pump()
    assert out.getvalue() == err.getvalue() == ""
    new_log = tmp_path / "logs" / "new_run" / "attempt_0" / "0" / "stderr.log"
    new_log.parent.mkdir(parents=True)
    new_log.write_text("this launch\n")
    with metrics.open("w") as f:  # rank 0 starts the file again (a fresh run)
        f.write(json.dumps({"step": 1, "loss": 5.5}) + "\n")
    os.utime(metrics, ns=(0, 1))  # a rewrite within the clock's resolution still differs (size, mtime)
    console.stop()
    assert err.getvalue().splitlines()[0] == "[rank 0] this launch"
    assert "earlier run" not in err.getvalue() and "loss 5.5" in err.getvalue() and "9.0" not in err.getvalue()


def test_a_resumed_run_draws_from_its_newest_line_and_counts_its_rate_from_there(tmp_path):
    """A resumed run's metrics.jsonl holds the earlier lines it kept (steps 10-50 of 100): the first read draws only
    the newest of them, and the rate (the ETA) counts from it, not from step 0 in a moment."""
    import io
    import json

    from disttrain.console import Console

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(10, 71, 10)))
    err = io.StringIO()
    console = Console(tmp_path / "logs", metrics, total=100, out=io.StringIO(), err=err)
    console.pump()  # the interrupted launch's file: not shown
    # rank 0 resumes from step 50: it keeps the lines up to there and appends from step 51
    metrics.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(10, 51, 10)))
    os.utime(metrics, ns=(0, 1))  # (a rewrite within the clock's resolution still differs)
    console.pump()
    assert [line.split("] ")[1].split(" ")[0] for line in err.getvalue().splitlines()] == ["50/100"]
    assert console.bar.start_step == 50 and "eta" not in err.getvalue()  # no rate yet
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 60, "loss": 8.0}) + "\n")
    console.stop()
    assert re.search(r"60/100 \| loss 8\.0000 \| eta \d:\d\d:\d\d", err.getvalue())
