import torch

from disttrain.config import DistConfig
from disttrain.runtime import LaunchInfo, detect_launch, init_runtime, pick_backend, pick_device


def test_detects_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert detect_launch(env) == LaunchInfo("torchrun", rank=3, local_rank=1, world_size=4,
                                            local_world_size=2, node_rank=1)


def test_detects_slurm():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_NTASKS_PER_NODE": "4(x2)"}
    assert detect_launch(env) == LaunchInfo("slurm", rank=5, local_rank=1, world_size=8,
                                            local_world_size=4, node_rank=2)


def test_torchrun_wins_over_slurm_and_default_is_single():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert detect_launch(env).launcher == "torchrun"
    assert detect_launch({}) == LaunchInfo("single")


def test_device_and_backend_choice():
    assert pick_device("cpu", 3) == torch.device("cpu")
    assert pick_backend("auto", torch.device("cpu")) == "gloo"
    assert pick_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert pick_backend("gloo", torch.device("cuda", 0)) == "gloo"


def test_single_process_runtime_has_no_process_group():
    rt = init_runtime(DistConfig(device="cpu", threads_per_rank=1), environ={})
    assert (rt.rank, rt.world_size, rt.distributed, rt.is_main_process()) == (0, 1, False, True)
    rt.barrier()  # a no-op without a process group
