"""Benchmark: a TrainingService's weight sync to inference engines, against the same bytes through one socket.

    disttrain bench weight-sync [--nproc 2] [--consumers 2] [--layers 8] [--d-model 1024] [--dtype bfloat16]
                                [--repeats 3] [--lr 1e-6] [--out bench_results]

A local fsdp service of `--nproc` ranks holds a GPT of `--layers` x `--d-model` (8 x 1024: ~101M parameters).
`--consumers` engine processes (`WeightReceiver`) take `--repeats` full versions in `--dtype`, then one
optimizer step at learning rate `--lr` runs and a delta version follows. Figures: a full sync's seconds (median of
the versions after the first, which also allocates the engines' buffers), its ratio to the time the model's bytes
take through one loopback socket into one process (a plain `sendall` into `recv_into`, median of `--repeats`) and
to that time for the bytes moved (one copy per engine), and the delta's bytes and seconds. Results:
`<out>/weight_sync.json` and `.md`.
"""

from __future__ import annotations

import asyncio
import json
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from disttrain.bench import check_numbers
from disttrain.errors import ArgumentParser, ConfigError, make_folder


def _args(argv):
    p = ArgumentParser(prog="disttrain bench weight-sync", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--consumers", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--out", default="bench_results")
    return p.parse_args(argv)


def consume(endpoint: str, name: str, versions: int) -> None:
    """An engine process: take `versions` versions, printing each one's number and receive time."""
    import torch

    from disttrain.service.weights import WeightReceiver

    torch.set_num_threads(1)
    receiver = WeightReceiver(endpoint, name)
    print(json.dumps({"ready": name}), flush=True)
    for _ in range(versions):
        start = time.perf_counter()
        version = receiver.receive(timeout_s=600)
        print(json.dumps({"version": version, "seconds": time.perf_counter() - start}), flush=True)
    receiver.close()


def _reader(port: int, nbytes: int) -> None:
    """One socket's far end: read `nbytes` into one buffer, say done."""
    import torch

    sock = socket.create_connection(("127.0.0.1", port))
    buffer = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
    got = 0
    while got < nbytes:
        got += sock.recv_into(buffer[got:])
    sock.sendall(b"k")
    sock.close()


def one_socket_seconds(nbytes: int, repeats: int) -> list[float]:
    """The model's bytes through one loopback socket into another process."""
    import torch

    data = memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy())
    times = []
    for _ in range(repeats):
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-c", f"from disttrain.bench.weight_sync import _reader; "
                                                       f"_reader({port}, {nbytes})"])
        conn, _ = server.accept()
        start = time.perf_counter()
        conn.sendall(data)
        assert conn.recv(1) == b"k"
        times.append(time.perf_counter() - start)
        conn.close()
        server.close()
        proc.wait()
    return times


async def sync_figures(args) -> dict:
    from disttrain.service import TrainingService

    heads = max(1, args.d_model // 64)
    model = {"n_layer": args.layers, "d_model": args.d_model, "n_head": heads, "seq_len": 32}
    service = await TrainingService.options(nproc=args.nproc, threads_per_rank=1).as_service(
        "gpt", model_args=model, optimizer={"lr": args.lr, "warmup_steps": 0, "weight_decay": 0.0},
        strategy="fsdp" if args.nproc > 1 else "single")
    engines = []
    try:
        sync = await service.weight_sync(consumers=args.consumers, dtype=args.dtype, bucket_mb=args.bucket_mb,
                                         timeout_s=600)
        for i in range(args.consumers):
            engines.append(subprocess.Popen(
                [sys.executable, "-c", "import sys; from disttrain.bench.weight_sync import consume; "
                                       "consume(sys.argv[1], sys.argv[2], int(sys.argv[3]))",
                 sync.endpoint, f"engine{i}", str(args.repeats + 1)], stdout=subprocess.PIPE, text=True))
        for engine in engines:
            json.loads(engine.stdout.readline())
        full = [await sync.push(delta=False) for _ in range(args.repeats)]
        ids = __import__("torch").randint(0, 256, (4, 32))
        await service.forward_backward({"input_ids": ids, "labels": ids})
        await service.optim_step()
        delta = await sync.push(delta=True)
        for engine in engines:
            received = [json.loads(engine.stdout.readline()) for _ in range(args.repeats + 1)]
            print(engine.args[-2], "receive seconds", [round(r["seconds"], 3) for r in received])
        for r in full + [delta]:
            print(f"push {r['seconds']:.3f} s; per rank", [round(x["seconds"], 3) for x in r["ranks"]])
    finally:
        for engine in engines:
            if engine.poll() is None:
                engine.kill()
            engine.wait()
        await service.shutdown()
    return {"model": model, "full": full, "delta": delta}


def main(argv=None) -> int:
    from disttrain._version import __version__

    args = _args(argv or [])
    check_numbers(("--nproc", args.nproc, 1), ("--consumers", args.consumers, 1), ("--layers", args.layers, 1),
                  ("--d-model", args.d_model, 1), ("--repeats", args.repeats, 1), ("--lr", args.lr, 0),
                  ("--bucket-mb", args.bucket_mb, 1e-3))
    if args.d_model % max(1, args.d_model // 64):
        raise ConfigError(f"--d-model {args.d_model}: must divide into heads of about 64 (e.g. 512, 1024)")
    out = make_folder(Path(args.out), "--out")
    figures = asyncio.run(sync_figures(args))
    full_bytes = figures["full"][0]["full_bytes"]
    times = [r["seconds"] for r in figures["full"]]
    sync_s = statistics.median(times[1:] or times)  # after the first version: the engines' buffers exist
    socket_times = one_socket_seconds(full_bytes, args.repeats)
    socket_s = statistics.median(socket_times)
    delta = figures["delta"]
    result = {"nproc": args.nproc, "consumers": args.consumers, "dtype": args.dtype, "model": figures["model"],
              "model_bytes": full_bytes, "sync_seconds": [r["seconds"] for r in figures["full"]],
              "one_socket_seconds": socket_times, "ratio": sync_s / socket_s,
              "ratio_to_bytes_moved": sync_s / (args.consumers * socket_s),
              "delta_bytes": delta["bytes"], "delta_seconds": delta["seconds"], "lr": args.lr,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "disttrain": __version__}
    (out / "weight_sync.json").write_text(json.dumps(result, indent=2))
    params = full_bytes / {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype] / 1e6
    lines = [f"# Weight sync: {args.nproc} fsdp ranks -> {args.consumers} engines ({result['date']})", "",
             f"A GPT of {args.layers} x {args.d_model} (~{params:,.0f}M parameters), {full_bytes / 1e6:,.0f} MB in "
             f"{args.dtype}:", "",
             f"- full sync to {args.consumers} engines: **{sync_s:.3f} s** (median after the first version; all: "
             f"{', '.join(f'{t:.3f}' for t in times)} s)",
             f"- the model's bytes through one socket into one process: {socket_s:.3f} s "
             f"(median of {', '.join(f'{t:.3f}' for t in socket_times)} s)",
             f"- ratio: **{result['ratio']:.2f}x** the model's bytes once; **{result['ratio_to_bytes_moved']:.2f}x** "
             f"the bytes moved (each engine gets its own copy: {args.consumers}x)",
             f"- delta after one optimizer step at lr {args.lr:g}: **{delta['bytes'] / 1e6:,.2f} MB** to "
             f"{args.consumers} engines ({delta['bytes'] / (args.consumers * full_bytes):.1%} of full) in "
             f"{delta['seconds']:.3f} s", "",
             f"disttrain {__version__}, Python {platform.python_version()}, {platform.node()}."]
    (out / "weight_sync.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
