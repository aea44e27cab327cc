"""Launch and survive: failure summaries, hangs, restarts with auto-resume, preemption, multi-node on loopback,
Slurm-style start, and rank agreement. Real processes, real signals, bounded waits."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import DISTTRAIN, SCRIPTS, cli_env, free_port, processes_mentioning, read_metrics, run_cli

JOB = ["--set", "model.name=tiny_models:faulty", "--set", "optim.lr=0.05", "--set", "data.global_batch_size=8",
       "--set", "data.micro_batch_size=4", "--set", "train.eval_every=0", "--set", "log.progress=false",
       "--set", "train.log_every=1"]  # a line every step: the tests wait for them


def _job(tmp, name, steps=20, *extra):
    return ["train", "--nproc", "2", "--set", f"run.out_dir={tmp}", "--set", f"run.name={name}",
            "--set", f"train.steps={steps}", *JOB, *extra]



@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 20-step run every recovery must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    result = run_cli(_job(tmp, "straight", 20, "--set", "checkpoint.every=5"), tmp, env={"FAULT_STEP": "0"})
    assert result.returncode == 0, result.stderr
    return [m["loss"] for m in read_metrics(tmp / "straight")]


def test_a_forked_script_sees_what_a_started_one_sees_and_ends_the_same_way(tmp_path):
    """`disttrain launch --fork` runs the script in ranks forked from a server that imported torch: the script's
    argv, `__name__`, import path, folder and one torch thread per rank are those of a started rank, and a rank's
    `sys.exit(3)` fails the job with the same code; `os._exit(0)` ends a forked rank as it ends a started one
    (torch's agent waits for a forked rank's return value: without disttrain's care it would wait for ever)."""
    script = str(Path(__file__).parent / "scripts" / "forked_view.py")
    views, codes = {}, {}
    for mode, code in (("started", ""), ("started", "3"), ("forked", ""), ("forked", "3"), ("forked", "os._exit")):
        out = tmp_path / f"{mode}{code}"
        out.mkdir()
        fork = ["--fork"] if mode == "forked" else []
        result = run_cli(["launch", *fork, "--nproc", "2", "--run-dir", str(out / "run"), script, str(out),
                          *([code] if code else [])], tmp_path, timeout=60)
        codes[mode, code] = result.returncode
        views[mode, code] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert codes == {("started", ""): 0, ("forked", ""): 0, ("started", "3"): 3, ("forked", "3"): 3,
                     ("forked", "os._exit"): 0}
    assert [v["preloaded"] for v in views["started", ""]] == [False, False]
    assert [v["preloaded"] for v in views["forked", ""]] == [True, True]
    for started, forked in zip(views["started", ""], views["forked", ""], strict=True):
        assert forked["argv"] == [script, str(tmp_path / "forked")] and started["argv"][0] == script
        assert {**forked, "preloaded": None, "argv": None} == {**started, "preloaded": None, "argv": None}
        assert forked["threads"] == 1 and forked["name"] == "__main__" and forked["path0"] == str(Path(script).parent)
        assert forked["child_unwound"] is started["child_unwound"] is False


def test_a_rank_that_raises_ends_the_job_with_a_summary(tmp_path):
    start = time.monotonic()
    result = run_cli(_job(tmp_path, "raises"), tmp_path, env={"FAULT": "raise", "FAULT_RANK": "1", "FAULT_STEP": "7"})
    elapsed = time.monotonic() - start
    assert result.returncode != 0 and elapsed < 20  # ~4 s of start-up, then the failure ends the job at once
    err = result.stderr
    assert "job failed" in err and "rank 1 raised ValueError at step 7" in err
    assert "injected failure at step 7" in err and "rank 0 (node 0" in err and "rank 1 (node 0" in err
    assert list((tmp_path / "raises" / "logs").rglob("stderr.log"))  # full per-rank logs kept


def test_out_of_memory_is_named_with_advice(tmp_path):
    result = run_cli(_job(tmp_path, "oom"), tmp_path, env={"FAULT": "oom", "FAULT_RANK": "0", "FAULT_STEP": "3"})
    assert result.returncode != 0
    assert "rank 0 raised OutOfMemoryError at step 3 (forward)" in result.stderr
    assert "estimate-memory" in result.stderr and "activation_checkpointing" in result.stderr


@pytest.mark.parametrize("entry", ["train", "run"])
def test_out_of_memory_in_one_process_is_one_line_with_advice(tmp_path, entry):
    """A real torch.OutOfMemoryError (a RuntimeError, not a MemoryError) raised by the model's forward, in
    `disttrain train --nproc 1` (the CLI's handler) and in `python -m disttrain.run` (the worker's)."""
    args = ["--set", f"run.out_dir={tmp_path}", "--set", "run.name=oom", "--set", "train.steps=5", *JOB]
    env = {**cli_env(tmp_path), "FAULT": "oom", "FAULT_RANK": "0", "FAULT_STEP": "3"}
    command = DISTTRAIN + ["train", "--nproc", "1", *args] if entry == "train" else \
        [sys.executable, "-m", "disttrain.run", *args]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    line = [x for x in result.stderr.splitlines() if x.startswith("disttrain: error:")]
    assert len(line) == 1 and "out of memory (injected: cannot allocate 64 GiB)" in line[0]
    assert "micro_batch_size" in line[0] and "estimate-memory" in line[0]


@pytest.mark.parametrize("entry", ["train", "launch"])
def test_a_hung_rank_is_named_within_timeout_with_its_stack(tmp_path, entry):
    """`disttrain train`, and `disttrain launch --run-dir D` of a script whose trainer writes its run elsewhere
    (`run.out_dir`): its ranks' statuses go to the folder the launcher watches, D."""
    job = _job(tmp_path, "hang", 20, "--set", "dist.timeout_s=8")
    if entry == "launch":
        job = ["launch", "--nproc", "2", "--run-dir", str(tmp_path / "launcher"), "-m", "disttrain.run", *job[3:]]
    start = time.monotonic()
    result = run_cli(job, tmp_path, timeout=90, env={"FAULT": "sleep", "FAULT_RANK": "1", "FAULT_STEP": "5"})
    elapsed = time.monotonic() - start
    assert result.returncode != 0 and elapsed < 30
    # only the rank the other waits for is named: rank 0 waits in a collective (its heartbeat read its flight recorder)
    assert "rank(s) 1 made no progress for 8s" in result.stderr
    assert "stuck: rank 1 in forward after step 4; other ranks were waiting for it" in result.stderr
    # where it hung: its stack, asked for before it was killed (faulthandler, from a C signal handler)
    stack = result.stderr.split("rank 1's stack when stopped (most recent call first; every thread's: ")[1]
    assert stack.splitlines()[0].endswith("rank1.stack):")
    frames = stack.splitlines()[1:]
    assert "tiny_models.py" in frames[0] and frames[0].endswith("in forward"), frames[:3]
    # which collective each rank waits in (torch's flight recorder): rank 1 never started the one rank 0 waits in
    collectives = result.stderr.split("collectives (torch's flight recorder; every record: ")[1].splitlines()
    waiting = re.fullmatch(r"    rank 0: waiting in gloo:all_reduce \w+ \[\d+\] #(\d+) of default_pg, for \d+ s",
                           collectives[1])
    assert waiting, collectives
    assert re.fullmatch(r"    rank 1: none unfinished; its last: gloo:\w+ \w+ \[\d+\] #(\d+) of default_pg",
                        collectives[2]), collectives
    assert collectives[3].startswith(f"    default_pg: rank(s) 1 never started collective #{waiting[1]} "), collectives
    assert processes_mentioning(str(tmp_path)) == []
    assert (tmp_path / "hang" / "metrics.jsonl").is_file()  # the run itself is where the trainer was told


def test_the_rank_the_others_wait_for_is_named_not_the_waiting_ones():
    """`watchdog.stuck_ranks`: of the ranks past their limit, those not waiting in a collective; where every one
    waits (a collective some never started) or none said, those in their phase the longest; each rank's own
    limits (a launched script's config) before the launcher's."""
    from disttrain.watchdog import stuck_ranks

    def status(rank, since, step=4, **more):
        return {"rank": rank, "since": since, "step": step, "phase": "backward", **more}

    waiting, stuck = status(0, 100.0, in_collective=True), status(1, 100.5)  # rank 0 entered its phase first
    assert stuck_ranks([waiting, stuck], 60, 600, now=200) == [stuck]
    assert stuck_ranks([status(0, 100.0), status(1, 102.0)], 60, 600, now=200) == [status(0, 100.0)]
    every = [status(0, 100.0, in_collective=True), status(1, 100.4, in_collective=True),
             status(2, 150.0, in_collective=True)]  # all wait (a collective some never started): the longest
    assert stuck_ranks(every, 60, 600, now=200) == every[:2]
    # every rank past its limit waits in a collective: the one it waits for entered its phase later and is within
    # its own limit, and is named, not them
    late = status(1, 105.0, phase="forward")
    assert stuck_ranks([status(0, 100.0, in_collective=True), late], 60, 600, now=162) == [late]
    assert stuck_ranks([status(0, 100.0, in_collective=True), status(1, 105.0, phase="checkpoint")], 60, 600,
                       now=162) == [status(0, 100.0, in_collective=True)]  # (a checkpoint has no limit)
    own = [status(0, 100.0, timeout_s=300.0), status(1, 100.0, step=0, startup_timeout_s=50.0)]
    assert stuck_ranks(own, 60, 600, now=200) == own[1:]  # the job's limits, not the launcher's 60 s and 600 s


def _sleeping_job(tmp_path, name: str) -> subprocess.Popen:
    """A 2-rank job in the background whose rank 1 falls asleep in its third forward (a 10-minute watchdog limit)."""
    return subprocess.Popen(DISTTRAIN + _job(tmp_path, name, 20, "--set", "dist.timeout_s=600"), cwd=tmp_path,
                            env={**cli_env(tmp_path), "FAULT": "sleep", "FAULT_RANK": "1", "FAULT_STEP": "3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def test_status_shows_where_each_rank_of_a_running_job_is_and_the_job_goes_on(tmp_path):
    """`disttrain status RUN_DIR --dump` on a job whose rank 1 sleeps in its forward (rank 0 waits for it): each
    rank's step and phase, both stacks as they are now, and the collective rank 1 never started; asked twice, the
    second answer is fresh; the job is not stopped. A folder without statuses is one line, exit 2."""
    run_dir, proc = tmp_path / "live", _sleeping_job(tmp_path, "live")
    try:
        deadline = time.monotonic() + 60
        status = run_dir / "status" / "rank1.json"
        while not (status.exists() and '"phase": "forward"' in status.read_text() and '"step": 2' in
                   status.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)  # (rank 0 reaches its collective)
        sizes = []
        for _ in range(2):
            out = run_cli(["status", str(run_dir), "--dump"], tmp_path)
            assert out.returncode == 0, out.stderr
            assert re.search(r"rank 1 \(node 0, [^,]+, pid \d+\): step 2, forward for \d+ s", out.stdout), out.stdout
            assert "rank 1's stack now (most recent call first; every thread's: " in out.stdout, out.stdout
            rank1 = out.stdout.split("rank 1's stack now (most recent call first; every thread's: ")[1].splitlines()
            assert "tiny_models.py" in rank1[1] and rank1[1].endswith("in forward"), rank1[:3]
            assert "rank 0: waiting in gloo:" in out.stdout and "rank(s) 1 never started collective #" in out.stdout
            sizes.append((run_dir / "status" / "rank1.stack").stat().st_size)
        assert 0 < sizes[0] < sizes[1]  # each request answered anew, after the one before (nothing erased)
        pids = [json.loads((run_dir / "status" / f"rank{r}.json").read_text())["pid"] for r in range(2)]
        for pid in pids:
            os.kill(pid, 0)  # the job goes on: both ranks are alive
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # (its ranks see their launcher gone and end: RankStatus._orphaned)
        proc.wait()
    deadline = time.monotonic() + 20
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(run_dir)) == []
    missing = run_cli(["status", str(tmp_path / "nowhere")], tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no rank status here" in missing.stderr


def test_workers_end_when_their_launcher_is_killed(tmp_path):
    """SIGKILL of the launcher (kill -9, the OOM killer): torchrun starts each worker in a session of its own, so
    nothing signals them, and a rank blocked outside a collective (asleep in its forward here; rank 0 waits in a
    collective with a 10-minute timeout) would live on. Each rank's heartbeat sees its parent gone and ends it."""
    run_dir, proc = tmp_path / "orphans", _sleeping_job(tmp_path, "orphans")
    try:
        deadline = time.monotonic() + 60
        while len(read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        workers = processes_mentioning(str(run_dir))
        assert len(workers) >= 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_mentioning(str(run_dir)) == []
    finally:
        for pid in processes_mentioning(str(run_dir)):
            os.kill(pid, signal.SIGKILL)


def test_sigkill_with_restarts_resumes_and_finishes_like_an_uninterrupted_run(tmp_path, reference):
    kill_after = random.Random().randint(6, 14)
    args = _job(tmp_path, "killed", 20, "--set", "checkpoint.every=5", "--set", "dist.timeout_s=15") + [
        "--max-restarts", "2"]
    proc = subprocess.Popen(DISTTRAIN + args, cwd=tmp_path, env={**cli_env(tmp_path), "FAULT_STEP": "0"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics = tmp_path / "killed" / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        from test_checkpoint_resume import _rank_pid

        os.kill(_rank_pid(str(tmp_path / "killed"), 1), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert "resumed from checkpoint step" in err
    assert [m["loss"] for m in read_metrics(tmp_path / "killed")][-1] == pytest.approx(reference[-1], abs=1e-6)


def test_restart_budget_exhausted_after_exactly_k_plus_one_attempts(tmp_path):
    result = run_cli(_job(tmp_path, "budget", 20, "--set", "checkpoint.every=5", "--set", "dist.timeout_s=15")
                     + ["--max-restarts", "2"], tmp_path, timeout=240,
                     env={"FAULT": "raise", "FAULT_RANK": "1", "FAULT_STEP": "7"})
    assert result.returncode == 1 and "job failed" in result.stderr
    attempts = {p.name for p in (tmp_path / "budget" / "logs").glob("*/attempt_*")}
    assert attempts == {"attempt_0", "attempt_1", "attempt_2"}
    assert run_cli(["ckpt", "verify", str(tmp_path / "budget")], tmp_path).returncode == 0  # checkpoints intact


def test_sigterm_checkpoints_exits_143_and_the_next_run_resumes(tmp_path, reference):
    args = _job(tmp_path, "preempted", 20, "--set", "checkpoint.every=100")
    proc = subprocess.Popen(DISTTRAIN + args, cwd=tmp_path, env={**cli_env(tmp_path), "FAULT_STEP": "0"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 6):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    committed = run_cli(["ckpt", "list", str(tmp_path / "preempted")], tmp_path).stdout
    assert "committed" in committed  # a checkpoint at the step where every rank agreed to stop
    assert processes_mentioning(str(tmp_path / "preempted")) == []
    resumed = run_cli(args, tmp_path, env={"FAULT_STEP": "0"})
    assert resumed.returncode == 0 and "resumed from checkpoint step" in resumed.stderr
    assert [m["loss"] for m in read_metrics(tmp_path / "preempted")] == pytest.approx(reference, abs=1e-6)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int] | None, list[str]]:
    """Each process's exit code (None: some ran over `timeout`, and every one left is killed) and its stderr."""
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return codes, [proc.stderr.read() for proc in procs]


@pytest.mark.parametrize("fault", [{"FAULT_STEP": "0"},
                                   {"FAULT": "raise", "FAULT_RANK": "1", "FAULT_STEP": "7", "FAULT_ATTEMPTS": "1"}],
                         ids=["straight", "a-rank-fails-once"])
def test_two_nodes_on_loopback_match_one_node(tmp_path, reference, fault):
    """Two launchers of one node each; with a rank failing once (`--max-restarts 1`) both nodes restart together,
    resume from the step-5 checkpoint and end as the uninterrupted run did."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(DISTTRAIN + ["train", "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank),
                                           "--rdzv-endpoint", endpoint, "--max-restarts", "1",
                                           "--set", f"run.out_dir={tmp_path}",
                                           "--set", "run.name=multinode", "--set", "train.steps=20",
                                           "--set", "checkpoint.every=5", "--set", "dist.startup_timeout_s=60", *JOB],
                              cwd=tmp_path, env={**cli_env(tmp_path), **fault}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for rank in (0, 1)]
    codes, errors = _wait_all(nodes, timeout=120)
    assert codes == [0, 0], [e[-2000:] for e in errors]
    lines = read_metrics(tmp_path / "multinode")
    if "FAULT" in fault:  # the failed attempt's lines up to step 6, then the resumed run's from step 6
        assert all("resumed from checkpoint step 5" in e for e in errors), [e[-2000:] for e in errors]
        lines = [m for m in lines if m["step"] <= 5] + [m for m in lines if m["step"] > 5][-15:]
    assert [m["loss"] for m in lines] == pytest.approx(reference, abs=1e-5)


def test_a_rank_dead_on_another_node_stops_this_nodes_ranks_at_once(tmp_path):
    """One node, a host of another name (`localhost`, which resolves; in a UTS namespace of its own), loses its rank
    to SIGKILL while the other node's rank waits for it, as in an nccl collective that never returns. Its launcher
    gives up and says so in the rank's status file; the other node's watchdog stops its rank within seconds, not
    after dist.timeout_s (300 s), and its summary names the dead rank."""
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs permission to create a UTS namespace (root), to run a node under another host name")
    run_dir, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    other_host = ["unshare", "--uts", "sh", "-c", 'hostname localhost && exec "$@"', "sh"]
    nodes = [subprocess.Popen([*prefix, *DISTTRAIN, "launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank),
                               "--rdzv-endpoint", endpoint, "--run-dir", str(run_dir),
                               str(SCRIPTS / "remote_death.py"), str(run_dir), "localhost"],
                              cwd=tmp_path, env=cli_env(tmp_path),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank, prefix in ((0, []), (1, other_host))]
    codes, errors = _wait_all(nodes, timeout=90)
    assert codes == [1, 1], errors
    dead = re.search(r"disttrain: rank (\d) \(node (\d), localhost\) killed by signal SIGKILL, and its node's "
                     r"launcher gave up; stopping this node's ranks", errors[0])
    assert dead, errors[0]
    assert re.search(rf"rank {dead[1]} \(node {dead[2]}, localhost, pid \d+\): step 1, phase forward: killed by "
                     r"signal SIGKILL \(its node's launcher says\)", errors[0]), errors[0]
    assert f"ended on another node first: rank {dead[1]} (node {dead[2]}, localhost) killed by signal" in errors[0]


def test_a_previous_runs_ended_ranks_in_the_run_folder_stop_nothing():
    """A rank another node's launcher gave up on counts unless its process's status was in the run folder when the
    watch began (a previous run's, in a rerun); never this host's own ranks (its agent sees them), nor a rank that
    had finished."""
    from disttrain.watchdog import ended_elsewhere

    def status(rank, host, pid, ended=None, phase="forward"):
        return {"rank": rank, "host": host, "pid": pid, "node": rank, "phase": phase,
                **({"ended": ended} if ended else {})}

    before = {(0, "here", 10), (1, "there", 11)}  # the previous run's ranks
    assert ended_elsewhere([status(0, "here", 10), status(1, "there", 11, "killed by signal SIGKILL")], "here",
                           before) == []
    dead = status(1, "there", 21, "exited with code 1")  # this run's rank 1, dead before the first look at it
    assert ended_elsewhere([status(0, "here", 20, "killed by signal SIGKILL"), dead], "here", before) == [dead]
    assert ended_elsewhere([status(1, "there", 21, "killed by signal SIGTERM", phase="done")], "here", before) == []


def test_a_closed_rank_status_leaves_the_stack_signal_as_it_found_it(tmp_path):
    """A Trainer run in the caller's own process (a notebook, a test) registers for the stack signal and, closed,
    leaves its default: an ignored signal would be inherited by every process started later, which then could never
    register (their stacks missing from a hang's summary)."""
    import signal as signals

    from disttrain.monitor import STACK_SIGNAL, RankStatus

    assert signals.getsignal(STACK_SIGNAL) == signals.SIG_DFL
    for _ in range(2):
        status = RankStatus(tmp_path, 0, 0)
        assert status.state["stacks"] is True
        status.close()
        assert status.state["stacks"] is False and signals.getsignal(STACK_SIGNAL) == signals.SIG_DFL


def test_the_flight_recorders_records_say_who_waits_in_what_and_who_never_came():
    from disttrain.monitor import waits

    def entry(seq, name="gloo:all_reduce", done=True, group=("0", "default_pg"), p2p=False, age_s=0):
        return {"collective_seq_id": 0 if p2p else seq, "p2p_seq_id": seq if p2p else 0, "is_p2p": p2p,
                "profiling_name": name, "process_group": list(group), "retired": done, "input_sizes": [[4, 2]],
                "input_dtypes": ["Float"], "time_created_ns": 100 * 10**9 - age_s * 10**9}

    sub = ("3", "undefined")  # a group made by new_group: named by its number
    # two groups of one mesh dimension: one description, two names; rank 3 is in neither
    dp_a, dp_b = ("5", "mesh_dp"), ("6", "mesh_dp")
    records = {0: {"entries": [entry(1), entry(2, done=False, age_s=7), entry(4, group=dp_a), entry(1, group=sub,
                                                                                                       done=False)]},
               1: {"entries": [entry(1), entry(1, group=sub, done=False), entry(5, "nccl:send", p2p=True),
                               entry(9, group=dp_b)]},
               2: {"entries": [], "note": "no process group"},
               3: {"entries": [entry(2)]}}
    assert waits(records, now_ns=100 * 10**9) == [
        "rank 0: waiting in gloo:all_reduce Float [4, 2] #2 of default_pg, for 7 s",
        "rank 1: waiting in gloo:all_reduce Float [4, 2] #1 of group 3, for 0 s",
        "rank 2: no collective recorded (no process group)",
        "rank 3: none unfinished; its last: gloo:all_reduce Float [4, 2] #2 of default_pg",
        "default_pg: rank(s) 1 never started collective #2 (their last: #1), which the others did (they went on to #2)",
    ]  # (point-to-point sequences are per pair of ranks: not compared; nor groups with other members)


def _slurm_ranks(tmp_path, overrides_per_rank, cwds=None):
    port = free_port()
    procs = []
    for rank, overrides in enumerate(overrides_per_rank):
        env = {**cli_env(tmp_path), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
               "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "FAULT_STEP": "0"}
        procs.append(subprocess.Popen([sys.executable, "-m", "disttrain.run", *overrides],
                                      cwd=cwds[rank] if cwds else tmp_path, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    codes, errors = _wait_all(procs, timeout=120)
    return list(zip(codes or [None] * len(procs), errors, strict=True))


def test_slurm_started_ranks_form_one_job_that_matches(tmp_path, reference):
    args = ["--set", f"run.out_dir={tmp_path}", "--set", "run.name=slurm", "--set", "train.steps=20",
            "--set", "checkpoint.every=5", "--set", "dist.nproc=2", *JOB]
    results = _slurm_ranks(tmp_path, [args, args])
    assert [code for code, _ in results] == [0, 0], results
    assert [m["loss"] for m in read_metrics(tmp_path / "slurm")] == pytest.approx(reference, abs=1e-5)


def test_ranks_that_see_different_data_are_refused_naming_it(tmp_path):
    """The same config on both ranks, but a relative data.source that is another file on each (as per-node copies
    that differ, or a file still being written): one line on every rank, exit 2, before the first step (a rank with
    more evaluation rounds than the others would hang in them)."""
    cwds = [tmp_path / "a", tmp_path / "b"]
    for cwd, words in zip(cwds, (200, 300), strict=True):
        cwd.mkdir()
        (cwd / "corpus.txt").write_text(" ".join(["tokens"] * words))
    args = ["--set", f"run.out_dir={tmp_path}", "--set", "run.name=data", "--set", "dist.nproc=2",
            "--set", "data.source=corpus.txt", "--set", "model.seq_len=16", *JOB]
    results = _slurm_ranks(tmp_path, [args, args], cwds)
    assert [code for code, _ in results] == [2, 2], results
    assert any("rank(s) 1 see a different number of training samples than rank 0" in err for _, err in results)


def test_ranks_with_different_configs_are_refused_naming_the_difference(tmp_path):
    base = ["--set", f"run.out_dir={tmp_path}", "--set", "run.name=mismatch", "--set", "dist.nproc=2", *JOB]
    results = _slurm_ranks(tmp_path, [base + ["--set", "optim.lr=0.05"], base + ["--set", "optim.lr=0.01"]])
    assert all(code == 2 for code, _ in results)
    assert any("rank(s) 1 run a different config than rank 0" in err for _, err in results)


def test_ray_launcher_trains_like_torchrun_and_summarises_a_failure_the_same_way(tmp_path, reference, request):
    """`disttrain train --launcher ray`: the ranks as Ray actors (a local cluster the command starts) give the
    torchrun run's losses and checkpoints; a rank that raises ends each attempt with the same summary, and
    `--max-restarts 1` starts a second attempt that resumes from the checkpoint."""
    pytest.importorskip("ray")
    short = tempfile.mkdtemp(prefix="dtr", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    ray_env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": short}
    result = run_cli(_job(tmp_path, "ray", 20, "--set", "checkpoint.every=5", "--launcher", "ray"), tmp_path,
                     timeout=180, env={**ray_env, "FAULT_STEP": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "as Ray actors" in result.stderr
    assert [m["loss"] for m in read_metrics(tmp_path / "ray")] == pytest.approx(reference, abs=1e-6)
    assert run_cli(["ckpt", "verify", str(tmp_path / "ray")], tmp_path).returncode == 0
    # each rank's output in files of its own, as under torchrun, and on this terminal with its rank
    assert "[rank 0] disttrain: done" in result.stderr
    assert "disttrain: done" in (tmp_path / "ray" / "logs" / "ray" / "attempt_0" / "0" / "stderr.log").read_text()

    # SIGTERM to the launcher reaches every rank: each finishes its step and checkpoints; the job exits 143
    stopped = subprocess.Popen(DISTTRAIN + _job(tmp_path, "ray_stopped", 400, "--set", "checkpoint.every=1000",
                                                "--launcher", "ray"),
                               cwd=tmp_path, env={**cli_env(tmp_path), **ray_env, "FAULT_STEP": "0"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics, deadline = tmp_path / "ray_stopped" / "metrics.jsonl", time.monotonic() + 120
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert stopped.poll() is None and time.monotonic() < deadline, stopped.stderr.read()[-3000:]
            time.sleep(0.05)
        stopped.send_signal(signal.SIGTERM)
        err = stopped.communicate(timeout=90)[1]
    finally:
        if stopped.poll() is None:
            os.killpg(stopped.pid, signal.SIGKILL)
    assert stopped.returncode == 143 and "stopped by SIGTERM" in err, err[-3000:]
    assert len(read_metrics(tmp_path / "ray_stopped")) < 400
    assert "committed" in run_cli(["ckpt", "list", str(tmp_path / "ray_stopped")], tmp_path).stdout

    result = run_cli(_job(tmp_path, "ray_fails", 20, "--set", "checkpoint.every=5", "--launcher", "ray")
                     + ["--max-restarts", "1"], tmp_path, timeout=180,
                     env={**ray_env, "FAULT": "raise", "FAULT_RANK": "1", "FAULT_STEP": "7"})
    err = result.stderr
    assert result.returncode == 1 and err.count("job failed") == 2, err[-3000:]
    assert "rank 1 raised ValueError at step 7" in err and "injected failure at step 7" in err
    assert "resumed from checkpoint step 5" in err and "rank 0 (node 0" in err


def test_ray_launcher_refuses_nodes_and_bad_resources_in_one_line(tmp_path):
    for extra, says in ((["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"], "Ray places the ranks on its nodes"),
                        (["--set", "dist.ray_resources=gpu_a"], "'gpu_a' is not NAME=AMOUNT")):
        result = run_cli(_job(tmp_path, "refused", 2, "--launcher", "ray", *extra), tmp_path)
        assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
