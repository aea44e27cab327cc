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
    }
