"""Benchmark: how fast a batch crosses the TrainingService's wire, driver -> workers (and a small reply back).

    disttrain bench wire [--nproc 2] [--mib 256] [--repeats 5] [--out bench_results]

A local service of `--nproc` workers (a tiny GPT; the model is not used) receives a float32 batch of `--mib` MiB
through `service.call`, each worker its slice (as `forward_backward` sends a global batch), and answers with the
bytes it got. The figure is the batch's MB (10^6 bytes) over the call's wall time, median of `--repeats` calls after
one warm-up call: what the driver's encoding, loopback TCP and the workers' decoding sustain together. Results:
`<out>/wire.json` and `<out>/wire.md`.
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

from disttrain.bench import check_numbers
from disttrain.errors import ArgumentParser, make_folder


def _args(argv):
    p = ArgumentParser(prog="disttrain bench wire", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench_results")
    return p.parse_args(argv)


def received(shard) -> int:
    """What a worker answers: the bytes of its slice (a `service.call` target)."""
    return int(sum(t.numel() * t.element_size() for t in shard.values()))


async def call_times(args) -> tuple[list[float], int]:
    import torch

    from disttrain.service import TrainingService

    batch = {"x": torch.ones(args.mib * 2**20 // 4 // 1024, 1024)}
    service = await TrainingService.options(nproc=args.nproc, threads_per_rank=1).as_service(
        "gpt", model_args={"n_layer": 1, "d_model": 16, "n_head": 2, "seq_len": 8}, strategy="ddp")
    times, got = [], 0
    try:
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            got = sum(await service.call("disttrain.bench.wire:received", batch))
            times.append(time.perf_counter() - start)
    finally:
        await service.shutdown()
    return times[1:], got


def main(argv=None) -> int:
    from disttrain._version import __version__

    args = _args(argv or [])
    check_numbers(("--nproc", args.nproc, 1), ("--mib", args.mib, 1), ("--repeats", args.repeats, 1))
    out = make_folder(Path(args.out), "--out")
    times, got = asyncio.run(call_times(args))
    mb = got / 1e6
    rate = mb / statistics.median(times)
    result = {"nproc": args.nproc, "mib": args.mib, "bytes": got, "seconds": times, "MB_per_s": rate,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "disttrain": __version__}
    (out / "wire.json").write_text(json.dumps(result, indent=2))
    lines = [f"# TrainingService wire: driver -> {args.nproc} workers ({result['date']})", "",
             f"A {args.mib} MiB float32 batch split over {args.nproc} local workers by `service.call`, median of "
             f"{args.repeats} calls: **{rate:,.0f} MB/s** ({mb:,.0f} MB in {statistics.median(times):.3f} s; "
             f"calls {', '.join(f'{t:.3f}' for t in times)} s).", "",
             f"disttrain {__version__}, Python {platform.python_version()}, {platform.node()}."]
    (out / "wire.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
