"""`disttrain env`: what a bug report needs (versions, devices, backends, the detected launcher)."""

from __future__ import annotations

import os
import platform
import sys


def env_report() -> dict[str, str]:
    import numpy
    import torch
    import torch.distributed as dist

    from disttrain._version import __version__
    from disttrain.runtime import detect_launch

    launch = detect_launch(os.environ)
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {
        "disttrain": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda available": f"{cuda} (torch built with CUDA {torch.version.cuda})" if cuda else "False",
        "gpus": ", ".join(devices) or "none",
        "cpu cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "distributed backends": ", ".join(backends) or "none",
        "default device": "cuda" if cuda else "cpu",
        "default backend": "nccl" if cuda else "gloo",
        "detected launcher": (f"{launch.launcher} (rank {launch.rank} of {launch.world_size})"
                              if launch.launcher != "single" else "none (single process)"),
        "nccl": _nccl(torch),
        "optional extras": ", ".join(f"{name} {_version(name)}" for name in EXTRAS),  # (mlflow: or mlflow-skinny)
        "environment": ", ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ)
                                 if k in ENV_VARS or k.startswith("DISTTRAIN_DIST_")) or "none of the relevant ones",
    }


EXTRAS = ("transformers", "tokenizers", "datasets", "deepspeed", "ray", "matplotlib", "PyYAML", "tensorboard",
          "wandb", "mlflow", "anyio", "trio")
"""Optional packages disttrain uses when present (their versions, read without importing them)."""

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE",
            "GLOO_SOCKET_IFNAME",
            "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "RAY_ADDRESS")
"""Environment variables that change how a distributed job starts or talks (shown when set)."""


def _version(package: str) -> str:
    from importlib import metadata

    for name in (package, f"{package}-skinny"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "-"


def _nccl(torch) -> str:
    if not torch.distributed.is_nccl_available():
        return "not in this torch build"
    try:
        version = torch.cuda.nccl.version()
        return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception as exc:  # a CUDA build without a usable driver
        return f"built in, version unknown ({type(exc).__name__})"
