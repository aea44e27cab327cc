"""TrainingService and its worker tier: parity with the single-process reference, checkpoints, the
distributed utilities, failure detection with real signals, and the no-pickle wire."""

import asyncio
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as safetensors_load

from disttrain.errors import ConfigError
from disttrain.service import RemoteError, TrainingService, WorkerFailure, WorkersRestarted, split_batch
from disttrain.service.weights import WeightReceiver
from disttrain.service.wire import TOKEN_ENV, Connection, WireError, decode, encode, parse_prefix

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import service_job as job  # noqa: E402
from plain_reference import compare  # noqa: E402

STEPS = 20


@pytest.fixture(scope="module")
def reference() -> list[float]:
    torch.set_num_threads(1)
    return job.reference(STEPS)


@pytest.fixture(scope="module")
def plain():
    """The plain-torch loop's losses, grad norms and final parameters (tests/scripts/plain_reference.py)."""
    torch.set_num_threads(1)
    return job.plain(STEPS)


def assert_matches_plain(losses, grad_norms, weights, plain) -> None:
    problems = compare(losses, grad_norms, weights, plain)
    assert not problems, "; ".join(problems)


async def start(strategy="ddp", nproc=2, **options):
    return await TrainingService.options(nproc=nproc, threads_per_rank=1, **options).as_service(
        "gpt", model_args=job.MODEL, optimizer=job.OPTIM, strategy=strategy, seed=job.SEED)


async def train(service, start_step: int, steps: int, grad_norms: list | None = None, peek: bool = False
                ) -> list[float]:
    """Losses of steps start_step+1..steps; their grad norms are appended to `grad_norms` when given. `peek`: a
    forward without gradients between each step's backward and its optimizer step (an RL loop reading logits)."""
    losses = []
    for batch in job.batches(steps, start_step):
        await service.forward_backward(batch)
        if peek:
            await service.forward(batch)
        out = await service.optim_step()
        losses.append(out["loss"])
        if grad_norms is not None:
            grad_norms.append(out["grad_norm"])
    return losses


def assert_close(got, want, tol=1e-5):
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst <= tol, f"max |loss difference| {worst:.3g} > {tol}: {got} vs {want}"


# -- the wire --------------------------------------------------------------------------------------


def test_wire_round_trip_and_refusals():
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}
    prefix, body, *chunks = encode({"op": "x", "n": 1}, tensors)
    payload = b"".join(bytes(c) for c in chunks)
    assert parse_prefix(prefix) == (len(body), len(payload))
    message, back = decode(body, payload)
    assert message == {"op": "x", "n": 1}
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])
    assert torch.equal(safetensors_load(payload)["a"], tensors["a"])  # an ordinary safetensors buffer
    # slices of one batch are sent as views of it, no copy (a copy would live elsewhere in memory)
    rows = torch.arange(8.0).reshape(4, 2)
    _, body, *chunks = encode({}, {"x": rows[1:3], "y": rows[3:]})
    addresses = {np.frombuffer(c, dtype=np.uint8).ctypes.data for c in chunks[2:]}
    assert addresses == {rows[1:3].data_ptr(), rows[3:].data_ptr()}
    buffer = torch.frombuffer(bytearray(b"".join(bytes(c) for c in chunks)), dtype=torch.uint8)
    back = decode(body, buffer)[1]
    assert torch.equal(back["x"], rows[1:3]) and back["x"].data_ptr() > buffer.data_ptr()  # a view of the buffer
    with pytest.raises(WireError, match="outside"):  # offsets beyond the buffer are refused
        decode(body, buffer[:-8])
    evil = pickle.dumps({"op": "setup"})
    with pytest.raises(WireError, match="pickle"):
        parse_prefix(evil[:16])
    with pytest.raises(WireError, match="safetensors"):
        decode(b'{"op": "x"}', evil)
    with pytest.raises(WireError, match="not JSON"):
        decode(evil, b"")


def test_split_batch_follows_the_sampler_rule():
    batch = {"input_ids": torch.arange(10).reshape(5, 2), "scale": 2.0}
    parts = split_batch(batch, 2)
    assert [p["input_ids"][:, 0].tolist() for p in parts] == [[0, 2, 4], [6, 8]]
    assert all(p["scale"] == 2.0 for p in parts)
    with pytest.raises(ValueError, match="at least 3"):
        split_batch(torch.zeros(2, 1), 3)


class _Marker:
    """Unpickling this would create a file: the proof that a worker never unpickles."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_worker_rejects_a_pickle_and_tensors_that_are_not_safetensors(tmp_path):
    marker = tmp_path / "pwned"
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    env = {**os.environ, TOKEN_ENV: "t"}
    cmd = [sys.executable, "-m", "disttrain.service.worker", "--connect", f"127.0.0.1:{port}", "--rank", "0",
           "--world", "1", "--heartbeat", "30"]
    for attack in ("raw", "payload"):
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        try:
            server.settimeout(60)
            sock, _ = server.accept()
            conn = Connection(sock)
            hello, _ = conn.recv()
            assert hello["op"] == "hello" and hello["token"] == "t"
            evil = pickle.dumps(_Marker(marker))
            if attack == "raw":  # a pickle instead of a frame: rejected, and the worker leaves
                sock.sendall(evil)
                reply, _ = conn.recv()
                assert reply["op"] == "rejected" and "pickle" in reply["error"]
                assert proc.wait(timeout=30) == 2
            else:  # a well-formed prefix and header whose tensor payload is a pickle: rejected too
                prefix, body = encode({"op": "ping", "id": 1})
                sock.sendall(prefix[:8] + len(evil).to_bytes(8, "big") + body + evil)
                reply, _ = conn.recv()
                assert reply["op"] == "rejected" and "safetensors" in reply["error"]
                assert proc.wait(timeout=30) == 2
            conn.close()
        finally:
            proc.kill()
            proc.wait()
    server.close()
    assert not marker.exists()


# -- parity, checkpoints, utilities ----------------------------------------------------------------


def test_service_ddp_matches_reference_saves_loads_and_runs_collectives(tmp_path, reference, plain):
    async def scenario():
        service = await start("ddp")
        try:
            norms = []
            first = await train(service, 0, 10, norms)
            saved = await service.save(tmp_path / "ckpt")
            assert Path(saved).name == "step_10" and (Path(saved) / "COMMITTED").exists()
            second = await train(service, 10, STEPS, norms)
            assert_close(first + second, reference)
            assert_matches_plain(first + second, norms, await service.state_dict(), plain)
            assert await service.load(tmp_path / "ckpt") == 10
            again = await train(service, 10, STEPS)
            assert again == second  # the same state and batches give bitwise the same losses

            # forward: outputs in batch order, equal to one process's
            batch = next(job.batches(1))
            logits = await service.forward(batch)
            assert logits.shape == (job.GLOBAL_BATCH, job.MODEL["seq_len"], job.MODEL["vocab_size"]
                                    if "vocab_size" in job.MODEL else 256)
            one = job.GPT(job.ModelConfig(**job.MODEL))  # the same weights in this process
            one.load_state_dict(await service.state_dict())
            with torch.no_grad():
                expected = one.eval()(batch["input_ids"])
            assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()

            # a custom loss (a mean) through forward_backward; accumulation over two calls
            half = split_batch(batch, 2)
            m1 = await service.forward_backward(half[0], loss_fn="service_job:mean_loss", sync=False)
            m2 = await service.forward_backward(half[1], loss_fn="service_job:mean_loss")
            assert m1["count"] == m2["count"] == job.GLOBAL_BATCH // 2
            step = await service.optim_step()
            assert step["step"] == STEPS + 1 and step["count"] == job.GLOBAL_BATCH
            # two sync=True calls: each starts the step's totals all-reduce; the step counts both micro-batches
            for part in half:
                await service.forward_backward(part, loss_fn="service_job:mean_loss")
            step = await service.optim_step()
            assert step["step"] == STEPS + 2 and step["count"] == job.GLOBAL_BATCH
            # ... and in micro-batches inside the workers (one call): the same update as one big batch
            await service.load(tmp_path / "ckpt")
            whole = await train(service, 10, 12)
            await service.load(tmp_path / "ckpt")
            micro = []
            for b in job.batches(12, 10):
                metrics = await service.forward_backward(b, micro_batch_size=2)
                assert metrics["count"] == job.GLOBAL_BATCH * job.MODEL["seq_len"]
                micro.append((await service.optim_step())["loss"])
            assert_close(micro, whole, tol=1e-6)

            # the distributed utilities, run on every rank with its slice
            advantages = torch.randn(10, dtype=torch.float64)
            results = await service.call("service_job:collective_checks", {"advantages": advantages}, offset=1.0)
            whitened = torch.cat([r["whitened"] for r in results])
            expected = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
            assert torch.allclose(whitened, expected, atol=1e-12)
            for r in results:
                assert r["gathered"].tolist() == [0.0, 10.0, 11.0]
                assert r["mean"] == pytest.approx(1.5) and r["sum"] == 1.0
                assert r["json"] == [{"rank": 0}, {"rank": 1}]

            # a user error on every rank is reported with the worker's traceback; the service goes on
            with pytest.raises(RemoteError, match="loss_fn = 'service_job:nope'"):
                await service.forward_backward(batch, loss_fn="service_job:nope")
            # a global batch with no valid item: refused on every rank, gradients dropped; the service saves at once
            # (the refused step's micro-batches are no longer counted as pending) and goes on
            await service.forward_backward({**batch, "labels": torch.full_like(batch["labels"], -100)})
            with pytest.raises(RemoteError, match="EmptyBatchError: step 13: the global batch has no valid items"):
                await service.optim_step()
            assert Path(await service.save(tmp_path / "after_empty")).name == "step_12"
            await service.forward_backward(batch)
            assert (await service.optim_step())["step"] == 13
            weights = await service.state_dict()
            assert set(weights) == set(job.GPT(job.ModelConfig(**job.MODEL)).state_dict())
            status = await service.status()
            assert status["state"] == "healthy" and [w["state"] for w in status["workers"]] == ["healthy"] * 2
            assert status["devices"] == ["cpu", "cpu"]  # what each worker reported at setup
        finally:
            await service.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_service_fsdp_matches_reference(reference, plain, strategy):
    """Also with a forward between each backward and optimizer step: units it leaves gathered (zero2's, the root's)
    must not carry their pre-step weights into the next step."""
    async def scenario():
        service = await start(strategy)
        try:
            norms = []
            losses = await train(service, 0, STEPS, norms, peek=True)
            assert_close(losses, reference)
            assert_matches_plain(losses, norms, await service.state_dict(), plain)
            # 5 rows over 2 ranks (3 + 2) in micro-batches of 2: both ranks run 2 micro-batches, so FSDP's
            # collectives pair up; the loss is that of the whole batch
            five = split_batch(next(job.batches(1)), 8)[0:5]
            five = {k: torch.cat([p[k] for p in five]) for k in five[0]}
            micro = await service.forward_backward(five, micro_batch_size=2, sync=False)
            whole = await service.forward_backward(five)
            assert micro["count"] == whole["count"] and abs(micro["loss"] - whole["loss"]) < 1e-6
            await service.optim_step()
        finally:
            await service.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("nproc, strategy, parallel", [
    (4, "fsdp", {"pipeline": 2}), (2, "auto", {"tensor": 2, "sequence_parallel": True}), (2, "auto", {"context": 2}),
    (4, "auto", {"tensor": 2, "context": 2, "loss_parallel": True}), (4, "auto", {"pipeline": 2, "context": 2}),
    (2, "auto", {"context": 2, "compile": "aot_eager"})],
    ids=["pp2+fsdp2", "tp2+sp", "cp2", "tp2+cp2+lp", "pp2+cp2", "cp2+compile"])
def test_service_with_the_model_split_matches_reference(tmp_path, reference, plain, nproc, strategy, parallel):
    """A pipeline of two stages, each sharded over two ranks (state_dict gathers a stage's DTensors one at a time),
    the blocks split tensor-wise, each sequence over two ranks, tensor or pipeline and sequence (the logits split by
    vocabulary too), and compiled blocks (batches of several widths): the same
    losses, weights (every stage's), outputs (the vocabulary's and the sequence's shares joined once), and a
    checkpoint that reloads."""
    async def scenario():
        service = await TrainingService.options(nproc=nproc, threads_per_rank=1).as_service(
            "gpt", model_args=job.MODEL, optimizer=job.OPTIM, seed=job.SEED, strategy=strategy, parallel=parallel)
        try:
            norms = []
            first = await train(service, 0, 10, norms)
            await service.save(tmp_path / "ckpt")
            second = await train(service, 10, STEPS, norms)
            assert_close(first + second, reference)
            # tensor-parallel sums run in another order: ~1e-7 gradient differences, which AdamW's normalisation
            # lifts to ~1e-5 in weights whose gradients are near zero (the losses stay within 1e-5)
            problems = compare(first + second, norms, await service.state_dict(), plain, param_tol=5e-5)
            assert not problems, "; ".join(problems)
            batch = next(job.batches(1))
            one = job.GPT(job.ModelConfig(**job.MODEL))
            one.load_state_dict(await service.state_dict())
            with torch.no_grad():
                expected = one.eval()(batch["input_ids"])
            assert torch.allclose(await service.forward(batch), expected, atol=1e-5)
            # a weight sync assembles the same full tensors from the stages' or tensor shards' pieces
            sync = await service.weight_sync(bucket_mb=0.05)
            receiver = WeightReceiver(sync.endpoint, "engine")
            version, report = await asyncio.gather(asyncio.to_thread(receiver.receive, 30), sync.push())
            assert version == report["version"] == 1 and all(r["full_bytes"] for r in report["ranks"])
            weights = await service.state_dict()
            assert receiver.weights.keys() == weights.keys()
            assert all(torch.equal(receiver.weights[k], v) for k, v in weights.items())
            receiver.close()
            assert await service.load(tmp_path / "ckpt") == 10
            assert await train(service, 10, STEPS) == second
            # a step of two micro-batches of different widths, one of 11 tokens (rows of different lengths, each batch
            # padded to its longest): the plain model's loss over their tokens (sequence parallelism pads 11 to equal
            # shares, a context split to equal pieces, and with a pipeline cuts both at the wider one's width)
            one.load_state_dict(await service.state_dict())
            wide, narrow = next(job.batches(2, 1)), {k: v[:, :11] for k, v in next(job.batches(3, 2)).items()}
            with torch.no_grad():  # and the outputs of 11 tokens, cut back from what was padded
                assert torch.allclose(await service.forward(narrow), one(narrow["input_ids"]), atol=1e-5)
            if parallel.get("sequence_parallel"):  # a tensor batch is not padded: one line where shares are unequal
                with pytest.raises(RemoteError, match="sequence_parallel: a batch of 11 tokens cannot be cut into "
                                                      "parallel.tensor = 2 equal shares; give dict batches"):
                    await service.forward((narrow["input_ids"],))
                ten = narrow["input_ids"][:, :10]
                with torch.no_grad():
                    assert torch.allclose(await service.forward(ten), one(ten), atol=1e-5)
            await service.forward_backward(wide, sync=False)
            await service.forward_backward(narrow)
            with torch.no_grad():
                sums = [torch.nn.functional.cross_entropy(one(b["input_ids"]).flatten(0, 1), b["labels"].flatten(),
                                                          reduction="sum") for b in (wide, narrow)]
            expected = float(sum(sums)) / (wide["labels"].numel() + narrow["labels"].numel())
            assert abs((await service.optim_step())["loss"] - expected) < 1e-5
            if parallel.get("compile"):  # (compiled in each worker: not dynamo's eager fallback)
                assert all(graphs > 0 for graphs in await service.call("service_job:compiled_graphs"))
        finally:
            await service.shutdown()

    asyncio.run(scenario())


def test_service_refuses_a_layout_the_workers_cannot_form():
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        asyncio.run(TrainingService.options(nproc=3).as_service("gpt", model_args=job.MODEL,
                                                                 parallel={"tensor": 2}))
    # parallel.compile: a name torch.compile does not know, and a split it does not compose with (before any worker)
    for parallel, message in (({"compile": "inductr"}, "'inductr' is not a torch.compile backend here"),
                              ({"compile": "inductor", "tensor": 2}, "with parallel.tensor = 2: compiled")):
        with pytest.raises(ConfigError, match=message):
            asyncio.run(TrainingService.options(nproc=2).as_service("gpt", model_args=job.MODEL, parallel=parallel))


def test_a_wildcard_host_is_refused_and_a_rank_listens_on_its_own_machines_address():
    """Workers connect to `host`, so a wildcard (where to listen, not where to connect) is refused; a weight sync's
    rank listens on its own machine's address on the route to `host` (on another node it could not listen on the
    driver's)."""
    from disttrain.service.weights import own_address

    with pytest.raises(ConfigError, match="host = '0.0.0.0' is where to listen, not an address workers"):
        asyncio.run(TrainingService.options(nproc=1, host="0.0.0.0").as_service("gpt", model_args=job.MODEL))
    assert own_address("127.0.0.1") == "127.0.0.1" and own_address("localhost") == "localhost"
    elsewhere = "192.0.2.77"  # TEST-NET-1: routed, never answered (a UDP connect sends nothing)
    here = own_address(elsewhere)
    if here == elsewhere:
        pytest.skip("no route off this machine")
    socket.create_server((here, 0)).close()  # an address of this machine's


# -- failures --------------------------------------------------------------------------------------


def _signal(service, rank: int, sig: int) -> float:
    pid = service.group.workers[rank].pid
    os.kill(pid, sig)
    return time.monotonic()


def test_sigkill_under_restart_policy_restores_the_checkpoint_and_training_continues(tmp_path, reference):
    interval = 5.0

    async def scenario():
        service = await start("ddp", on_failure="restart", heartbeat_timeout_s=interval,
                              checkpoint_dir=str(tmp_path / "ckpt"))
        try:
            losses = await train(service, 0, 5)
            await service.save()
            await train(service, 5, 7)
            await service.save()  # step 7, the newest in the folder ...
            assert await service.load(step=5) == 5  # ... but the loop went back to step 5
            losses += await train(service, 5, 7)
            batch = next(job.batches(8, 7))
            killed = _signal(service, 1, signal.SIGKILL)
            with pytest.raises(WorkersRestarted) as info:
                await service.forward_backward(batch)
            # restored: the checkpoint the service last loaded (step 5), not the newest one (step 7)
            assert info.value.step == 5 and "worker 1" in str(info.value) and "SIGKILL" in str(info.value)
            status = await service.status()
            detected = status["failures"][0]["time"] - (time.time() - (time.monotonic() - killed))
            assert detected <= interval, f"detected {detected:.1f} s after the kill"
            assert status["restarts"] == 1 and status["state"] == "healthy" and status["step"] == 5
            losses = losses[:5] + await train(service, 5, 12)  # training continues from the checkpoint
            assert_close(losses, reference[:12])
        finally:
            await service.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "unresponsive"])
def test_fail_policy_names_the_worker_within_the_interval(sig):
    interval = 3.0

    async def scenario():
        service = await start("ddp", heartbeat_timeout_s=interval)
        pid = service.group.workers[1].pid
        try:
            await train(service, 0, 2)
            killed = time.monotonic()
            os.kill(pid, sig)
            with pytest.raises(WorkerFailure) as info:
                if sig == signal.SIGSTOP:  # 64 MiB to a worker that stopped reading: the send itself blocks
                    await service.call("service_job:rows", {"x": torch.zeros(2, 8 << 20)})
                for batch in job.batches(50, 2):  # a worker stopped mid-collective blocks the others
                    await service.forward_backward(batch)
                    await service.optim_step()
            raised = time.monotonic() - killed
            expected = "killed by SIGKILL" if sig == signal.SIGKILL else "sent no heartbeat"
            assert f"worker 1 (pid {pid}" in str(info.value) and expected in str(info.value)
            status = await service.status()
            detected = status["failures"][0]["time"] - (time.time() - (time.monotonic() - killed))
            # a dead worker is seen at once; a silent one after `interval` of silence plus one monitor tick
            assert detected <= interval + 1.0, f"the failure was detected {detected:.1f} s after the signal"
            assert raised <= interval + 10.0, f"the call raised {raised:.1f} s after the signal"
            with pytest.raises(WorkerFailure):  # the service stays failed
                await service.optim_step()
            assert (await service.status())["state"] == "failed"
        finally:
            await service.shutdown()
        with pytest.raises(ProcessLookupError):  # no orphan: shutdown reaped the stopped worker too
            os.kill(pid, 0)

    asyncio.run(scenario())


def test_a_worker_stuck_in_a_training_phase_is_named_within_timeout():
    """A worker whose main thread hangs still sends heartbeats; the driver names it once it has been in one training
    phase longer than `timeout_s` (its peer, waiting for it in the backward's all-reduce, entered its phase later),
    long before the collective's own timeout (`timeout_s` + `startup_timeout_s`), and no worker is left behind."""
    limit = 4.0

    async def scenario():
        service = await start("ddp", timeout_s=limit)
        pids = [service.group.workers[rank].pid for rank in range(2)]
        try:
            await train(service, 0, 1)
            begun = time.monotonic()
            with pytest.raises(WorkerFailure) as info:
                await service.forward_backward(next(job.batches(2, 1)), loss_fn="service_job:stalling_loss")
            raised = time.monotonic() - begun
            named, _, waits = str(info.value).partition("; ")
            assert named.startswith(f"worker 1 (pid {pids[1]} on ") and "in phase 'forward' at step 1 for" in named
            assert named.endswith(f": no progress (limit timeout_s = {limit:g})"), named
            assert waits == "worker(s) 0 waited for it in a collective", waits
            assert info.value.rank == 1
            assert limit <= raised <= limit + 10.0, f"named {raised:.1f} s after the call began"
            assert (await service.status())["state"] == "failed"
        finally:
            await service.shutdown()
        for pid in pids:  # the stuck worker and its waiting peer are both gone
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)

    asyncio.run(scenario())


def test_the_stuck_worker_is_the_one_the_others_wait_for_and_a_cold_one_gets_the_startup_limit():
    """`WorkerGroup._check_progress` on the health its workers' heartbeats reported: worker 0 has waited in a
    collective past `timeout_s` for worker 1, which entered its phase later (within its own limit): worker 1 is
    named. Before a worker's first optimizer step in its process, the limit is `startup_timeout_s`."""
    from types import SimpleNamespace

    from disttrain.service.group import WorkerGroup, WorkerHandle

    def group(warm: bool) -> WorkerGroup:
        g = WorkerGroup(None, 2, progress_timeout_s=4.0, startup_timeout_s=30.0)
        now = time.monotonic()
        writer = SimpleNamespace(transport=SimpleNamespace(abort=lambda: None))
        for rank, phase, since, waiting in ((0, "backward", now - 10, True), (1, "forward", now - 3, False)):
            g.workers[rank] = WorkerHandle(rank, 100 + rank, "vm", writer, now, phase=phase, phase_since=since,
                                           in_collective=waiting, warm=warm)
        g._check_progress()
        return g

    failure = group(warm=True).failure
    assert failure.rank == 1
    assert str(failure).startswith("worker 1 (pid 101 on vm) in phase 'forward' at step 0 for 3 s"), failure
    assert str(failure).endswith("(limit timeout_s = 4); worker(s) 0 waited for it in a collective"), failure
    assert group(warm=False).failure is None  # 10 s into its first step: within the startup limit


def run_rl_example(*args: str) -> dict:
    import json

    example = Path(__file__).parent.parent / "examples" / "rl_loop.py"
    proc = subprocess.run([sys.executable, str(example), "--iters", "30", *args], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["iterations"] == 30
    assert result["first_reward"] < 0.7 and result["last_reward"] >= 0.9, result  # random play earns 0.25
    return result


def test_a_failed_start_under_restart_policy_leaves_no_worker_behind(monkeypatch):
    from conftest import processes_mentioning

    monkeypatch.setenv("SERVICE_JOB_DIE_RANK", "1")  # service_job:dying_model exits on that rank

    async def scenario():
        with pytest.raises(WorkerFailure, match="worker 1 .* exited with code 9"):
            await TrainingService.options(nproc=2, threads_per_rank=1, on_failure="restart").as_service(
                "service_job:dying_model", strategy="ddp")
        await asyncio.sleep(1.0)  # a (wrong) background restart would have spawned workers by now

    asyncio.run(scenario())
    assert processes_mentioning("disttrain.service.worker") == []


DRIVER = """
import asyncio, sys, time
sys.path.insert(0, {scripts!r})
import service_job as job
from disttrain.service import TrainingService

async def main():
    service = await TrainingService.options(nproc=2, threads_per_rank=1).as_service(
        "gpt", model_args=job.MODEL, optimizer=job.OPTIM, strategy="ddp")
    busy = asyncio.ensure_future(service.call("service_job:sleep", None, seconds=600))  # workers never read
    await asyncio.sleep(0.5)
    print(" ".join(str(w.pid) for w in service.group.workers.values()), flush=True)
    await busy

asyncio.run(main())
"""


def test_busy_workers_die_with_a_killed_driver(tmp_path):
    """The workers are inside a long command (they would not notice the closed connection for 10 minutes):
    the kernel ends them with their driver."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(scripts=str(SCRIPTS)))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        driver.kill()  # SIGKILL: no cleanup code runs in the driver
        driver.wait()
        from conftest import processes_mentioning

        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = processes_mentioning(f"--parent {driver.pid}")  # this driver's workers
        assert not alive, f"workers {alive} outlived their driver"
    finally:
        driver.kill()


def test_rl_example_learns_on_two_local_workers():
    run_rl_example("--launcher", "local")


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of listening TCP sockets on `port` (from /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_worker_tier_on_its_own_and_listening_on_loopback_only():
    """Spawn workers with WorkerGroup and send them commands directly (no TrainingService)."""
    from disttrain.service import LocalLauncher, WorkerGroup
    from disttrain.service.wire import pack

    async def scenario():
        group = WorkerGroup(LocalLauncher(), 2)
        await group.start()
        try:
            loopback = {"0100007F"}  # 127.0.0.1 as /proc/net/tcp writes it
            assert _listening_addresses(group.port) == loopback
            assert _listening_addresses(group.store.port) == loopback
            setup = {"op": "setup", "model_fn": "gpt", "model_args": job.MODEL, "optimizer": job.OPTIM,
                     "strategy": "ddp", "seed": job.SEED, "store_host": "127.0.0.1", "store_port": group.store.port,
                     "threads": 1, "sys_path": [str(SCRIPTS)]}
            replies = await group.all([({**setup, "local_rank": r}, None) for r in range(2)])
            assert [r["rank"] for r, _ in replies] == [0, 1]
            losses = []
            for batch in job.batches(3):
                shards = [pack(part, "batch") for part in split_batch(batch, 2)]
                await group.all([({"op": "forward_backward", "batch": skeleton}, tensors)
                                 for skeleton, tensors in shards])
                replies = await group.all([({"op": "optim_step"}, None)] * 2)
                losses.append(replies[0][0]["metrics"]["loss"])
            assert_close(losses, job.reference(3))
            with pytest.raises(RemoteError, match="unknown command 'nope'"):
                await group.all([({"op": "nope"}, None)] * 2)
        finally:
            await group.close()

    asyncio.run(scenario())
