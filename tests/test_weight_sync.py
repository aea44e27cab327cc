"""Weight sync from a TrainingService to inference engines (service/weights/): every rank sends its own shards,
the engines hold exactly the trained weights (full and delta versions), and a dead, absent or corrupted consumer
is named within the timeout while the trainer stays usable."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from disttrain.service import TrainingService
from disttrain.service.weights import SCHEME, WeightReceiver, WeightSyncError

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import service_job as job  # noqa: E402


class Engine:
    """tests/scripts/toy_engine.py in its own process, driven over stdin/stdout."""

    def __init__(self, endpoint: str, name: str, *extra: str):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(SCRIPTS / "toy_engine.py"), endpoint, name, *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def ask(self, **command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline() or "null")

    def start_receive(self, timeout: float = 60.0) -> None:
        self.proc.stdin.write(json.dumps({"op": "receive", "timeout": timeout}) + "\n")
        self.proc.stdin.flush()

    def received(self):
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


async def start(lr: float):
    return await TrainingService.options(nproc=2, threads_per_rank=1).as_service(
        "gpt", model_args=job.MODEL, optimizer={**job.OPTIM, "lr": lr}, strategy="fsdp", seed=job.SEED)


async def push_while(sync, engines: list[Engine], **kwargs) -> dict:
    for engine in engines:
        engine.start_receive()
    report = await sync.push(**kwargs)
    for engine in engines:
        assert engine.received() == {"version": report["version"]}
    return report


def held(engine: Engine, tmp_path: Path) -> dict[str, torch.Tensor]:
    path = tmp_path / f"{engine.name}.safetensors"
    assert engine.ask(op="save", path=str(path)) == {"saved": str(path)}
    return load_file(path)


def test_fsdp_ranks_stream_their_shards_to_two_engines_in_full_then_as_a_delta(tmp_path):
    async def scenario():
        service = await start(lr=1e-5)  # a small learning rate: few bf16 values change in one step
        engines = []
        try:
            sync = await service.weight_sync(consumers=2, dtype="bfloat16", bucket_mb=0.02, timeout_s=60)
            # every bucket's receive buffer is recycled (a large model's are): a buffer reused before its bucket
            # was copied out would show as wrong weights below, in the full version or the delta
            engines = [Engine(sync.endpoint, f"engine{i}", "--recycle-from", "1") for i in range(2)]
            report = await push_while(sync, engines)
            trained = {k: v.to(torch.bfloat16) for k, v in (await service.state_dict()).items()}
            for engine in engines:
                weights = held(engine, tmp_path)
                assert weights.keys() == trained.keys()
                for name, tensor in trained.items():
                    assert torch.equal(weights[name], tensor), name
            # each rank sent its own shards, about half of the model, and no rank sent it all
            full = report["full_bytes"]
            assert [r["full_bytes"] for r in report["ranks"]] == pytest.approx([full / 2] * 2, rel=0.2)
            assert report["bytes"] == 2 * full  # to two engines
            # the engine answers forward calls with what it holds
            batch = next(job.batches(1))
            one = job.GPT(job.ModelConfig(**job.MODEL)).eval()
            one.load_state_dict({k: v.float() for k, v in trained.items()})
            with torch.no_grad():
                expected = one(batch["input_ids"][:2])
            logits = torch.tensor(engines[0].ask(op="forward", ids=batch["input_ids"][:2].tolist())["logits"])
            assert torch.allclose(logits, expected, atol=1e-5)

            await service.forward_backward(batch)
            await service.optim_step()
            delta = await push_while(sync, engines, delta=True)
            assert 0 < delta["bytes"] < 0.5 * delta["full_bytes"] * 2, delta["bytes"]
            stepped = {k: v.to(torch.bfloat16) for k, v in (await service.state_dict()).items()}
            changed = sum(int((stepped[k] != trained[k]).sum()) for k in trained)
            assert changed > 0
            for engine in engines:
                weights = held(engine, tmp_path)
                for name, tensor in stepped.items():
                    assert torch.equal(weights[name], tensor), name
        finally:
            for engine in engines:
                engine.close()
            await service.shutdown()

    asyncio.run(scenario())


class CorruptingProxy:
    """Forwards one consumer's connection to a rank, flipping one byte of the rank's stream at offset `at`."""

    def __init__(self, target: str, at: int):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        host, _, port = target.rpartition(":")
        self.target, self.at = (host, int(port)), at
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.server.accept()
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
        self._pump(upstream, client, self.at)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0xFF
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_a_dead_an_absent_and_a_corrupted_consumer_are_named_and_the_trainer_goes_on(tmp_path):
    async def scenario():
        service = await start(lr=job.OPTIM["lr"])
        engines = []
        try:
            sync = await service.weight_sync(consumers=1, bucket_mb=0.02, timeout_s=20)
            survivor = Engine(sync.endpoint, "survivor")
            dying = Engine(sync.endpoint, "dying", "--die-at-bucket", "3")
            engines = [survivor, dying]
            survivor.start_receive()
            dying.start_receive()
            began = time.monotonic()
            with pytest.raises(WeightSyncError, match=r"consumer 'dying' \(pid \d+.*disconnected during version 1"):
                await sync.push()
            assert time.monotonic() - began < 20
            assert dying.proc.wait(5) == -signal.SIGKILL
            assert survivor.received() == {"version": 1}  # the others got the version
            # the trainer is still usable, and the next version reaches the survivor alone
            await service.forward_backward(next(job.batches(1)))
            await service.optim_step()
            assert (await push_while(sync, [survivor]))["version"] == 2

            # a consumer that never connects: named within the timeout, not waited on
            lonely = await service.weight_sync(consumers=1, timeout_s=2)
            began = time.monotonic()
            with pytest.raises(WeightSyncError, match=r"1 of 1 consumer\(s\) never connected .*connected: none"):
                await lonely.push()
            assert time.monotonic() - began < 10
            await lonely.close()

            # a byte flipped on the way: the bucket fails its checksum, the consumer refuses the version and keeps
            # what it had, the push names it
            sync = await service.weight_sync(consumers=2, bucket_mb=0.02, timeout_s=20)
            clean = WeightReceiver(sync.endpoint, "clean")
            first, *others = sync.endpoint.removeprefix(SCHEME).partition("#")[0].split(",")
            proxy = CorruptingProxy(first, at=50_000)  # past the first frames' headers: inside a tensor
            token = sync.endpoint.partition("#")[2]
            victim = WeightReceiver(f"{SCHEME}{','.join([proxy.address, *others])}#{token}", "victim")
            outcomes = {}

            def receive(receiver):
                try:
                    outcomes[receiver.name] = receiver.receive(timeout_s=30)
                except WeightSyncError as exc:
                    outcomes[receiver.name] = str(exc)

            threads = [threading.Thread(target=receive, args=(r,)) for r in (clean, victim)]
            for t in threads:
                t.start()
            with pytest.raises(WeightSyncError, match=r"consumer 'victim' .*refused version 1: bucket \d+ from rank 0 "
                                                      r"failed its checksum") as refused:
                await sync.push()
            assert "'clean'" not in str(refused.value)
            for t in threads:
                t.join(30)
            assert outcomes["clean"] == 1 and clean.version == 1
            assert "failed its checksum" in outcomes["victim"] and victim.version == 0 and not victim.weights
            assert torch.equal(clean.weights["tok_emb.weight"], (await service.state_dict())["tok_emb.weight"])
            clean.close()
            victim.close()
        finally:
            for engine in engines:
                engine.close()
            await service.shutdown()

    asyncio.run(scenario())
