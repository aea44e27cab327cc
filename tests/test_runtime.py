import os
import subprocess
import sys
import time

import pytest
import torch

from disttrain.config import ConfigError, DistConfig
from disttrain.runtime import (
    LaunchInfo,
    detect_launch,
    first_host,
    init_runtime,
    loopback_gloo,
    pick_backend,
    pick_device,
)


def test_detects_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert detect_launch(env) == LaunchInfo("torchrun", rank=3, local_rank=1, world_size=4,
                                            local_world_size=2, node_rank=1)


def test_detects_slurm():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_NTASKS_PER_NODE": "4(x2)"}
    assert detect_launch(env) == LaunchInfo("slurm", rank=5, local_rank=1, world_size=8,
                                            local_world_size=4, node_rank=2)
    del env["SLURM_NTASKS_PER_NODE"]  # `srun -n 8` on 2 nodes: Slurm sets only SLURM_TASKS_PER_NODE
    assert detect_launch({**env, "SLURM_TASKS_PER_NODE": "4(x2)"}).local_world_size == 4


def test_ranks_that_each_see_another_single_gpu_are_bound_to_it():
    """A CUDA_VISIBLE_DEVICES of each rank's own (a wrapper per rank, Slurm's --gpu-bind) binds each rank to its GPU;
    one GPU seen by every rank of a node (torchrun's CUDA_VISIBLE_DEVICES=0) binds nothing. The ranks of a node
    compare their GPUs' UUIDs through the rendezvous store (a real one; the ranks are threads here)."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch.distributed as dist

    from disttrain.runtime import one_gpu_each

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))

    def node(name, gpus):  # (numbered by arrival: Ray's GPU actors all come as local rank 0)
        with ThreadPoolExecutor(len(gpus)) as pool:
            return list(pool.map(lambda gpu: one_gpu_each(store, name, len(gpus), gpu), gpus))

    assert node("a", ["GPU-0f", "GPU-1e", "GPU-2d"]) == [True] * 3
    assert node("b", ["GPU-0f", "GPU-0f"]) == [False] * 2
    store.set_timeout(timedelta(seconds=0.5))
    with pytest.raises(ConfigError, match="1 of the 2 ranks on c see more than one GPU, and 1 see one"):
        one_gpu_each(store, "c", 2, "GPU-0f")  # its peer saw several GPUs and never came


def test_torchrun_wins_over_slurm_and_default_is_single():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert detect_launch(env).launcher == "torchrun"
    assert detect_launch({}) == LaunchInfo("single")


def test_device_and_backend_choice():
    assert pick_device("cpu", 3) == torch.device("cpu")
    # on GPUs: the local rank's, GPU 0 where a launcher bound one GPU per rank, else one line
    assert pick_device("cuda", 3, visible=8) == torch.device("cuda", 3)
    assert pick_device("cuda", 3, visible=1, bound=True) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="local rank 1 needs GPU 1, and this process sees 1 GPU"):
        pick_device("cuda", 1, visible=1, bound=False)  # torchrun --nproc 2 on a one-GPU machine
    with pytest.raises(ConfigError, match="local rank 5 needs GPU 5, and this process sees 4 GPU"):
        pick_device("cuda", 5, visible=4)
    assert pick_backend("auto", torch.device("cpu")) == "gloo"
    assert pick_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert pick_backend("gloo", torch.device("cuda", 0)) == "gloo"


def test_single_process_runtime_has_no_process_group():
    rt = init_runtime(DistConfig(device="cpu", threads_per_rank=1), environ={})
    assert (rt.rank, rt.world_size, rt.distributed, rt.is_main_process()) == (0, 1, False, True)
    rt.barrier()  # a no-op without a process group


AFTER_A_LATE_SIGNAL = """
import os, signal, sys, time
from disttrain.signals import StopSignals

StopSignals.LEFT_S = 1.0
with StopSignals(grace_s=60) as stop:
    os.kill(os.getpid(), signal.SIGTERM)  # arrives as the run ends: it ends as it would have
    time.sleep(0.5)
assert stop.signum == signal.SIGTERM
print("ended", flush=True)
time.sleep(20)  # a rank left waiting for a launcher that no longer collects its result
print("still here", flush=True)
"""


@pytest.mark.parametrize("launched", [True, False])
def test_a_run_that_ends_after_a_stop_signal_leaves_soon_when_launched_and_goes_on_otherwise(tmp_path, launched):
    """A SIGTERM with the last step: a launched rank leaves `LEFT_S` after the run, not after the whole grace (torch's
    agent, shutting down, never collects a forked rank's result: `disttrain train` stayed 60 s); the caller's own
    process is not ended at all."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    if launched:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    start = time.monotonic()
    script = AFTER_A_LATE_SIGNAL if launched else AFTER_A_LATE_SIGNAL.replace("time.sleep(20)", "time.sleep(2)")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert done.stdout.splitlines()[:1] == ["ended"], done.stderr
    if launched:
        assert done.returncode == 128 + 15 and "still here" not in done.stdout and took < 15, (done.returncode, took)
    else:
        assert done.returncode == 0 and "still here" in done.stdout, done.stderr


def test_slurm_rendezvous_is_the_first_node_of_the_step():
    assert first_host("gpu[003-010,012],big1") == "gpu003"
    assert first_host("node7") == "node7"
    assert first_host("login2,gpu[01-04]") == "login2"
    assert first_host("a-b[9,11-12]") == "a-b9"
    assert first_host("node[1-2]-ib,x") == "node1-ib"
    assert first_host("rack[1-2]-n[01-04],z") == "rack1-n01"


def test_gloo_across_nodes_from_a_host_named_on_loopback_is_refused(monkeypatch):
    """Debian's /etc/hosts maps the host's name to 127.0.1.1: gloo would give that to the other nodes' ranks."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")  # a rendezvous on another machine (TEST-NET-1, no lookup)
    assert "resolves to 127.0.0.1 (loopback)" in loopback_gloo(16, 8, hostname="localhost")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # every "node" on this machine (two Ray nodes started here)
    assert loopback_gloo(16, 8, hostname="localhost") is None
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")
    assert loopback_gloo(8, 8, hostname="localhost") is None  # one node: every peer is on loopback too
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert loopback_gloo(16, 8, hostname="localhost") is None  # the interface is named


def test_service_local_ranks_follow_the_nodes_ray_placed_the_workers_on():
    from types import SimpleNamespace

    from disttrain.service.lifecycle import _local_ranks

    assert _local_ranks(SimpleNamespace(), 3) == [(0, 3), (1, 3), (2, 3)]  # the local launchers: one machine
    spread = SimpleNamespace(nodes=["a", "b", "a", "b"], gpus=[[], [], [], []])
    assert _local_ranks(spread, 4) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    gpus = SimpleNamespace(nodes=["a", "a"], gpus=[["3"], ["5"]])  # each actor sees its own GPU only: cuda:0
    assert _local_ranks(gpus, 2) == [(0, 2), (0, 2)]
    with pytest.raises(ConfigError, match="Ray put ranks 0 and 1 on GPU 3 of one node"):
        _local_ranks(SimpleNamespace(nodes=["a", "a"], gpus=[["3"], ["3"]]), 2)
    assert _local_ranks(SimpleNamespace(nodes=["a", "a"], gpus=[["3"], ["3"]]), 2, gpu_ranks=False) == [(0, 2), (0, 2)]


def test_ray_actors_take_ranks_by_node_then_gpu():
    from disttrain.service.ray_launcher import node_order

    # SPREAD over two nodes: bundles alternate; ranks go to node a's actors first, each node's by GPU id
    assert node_order(["a", "b", "a", "b"], [["1"], ["0"], ["0"], ["1"]]) == [2, 0, 1, 3]
    assert node_order(["a", "a", "a"], [[], [], []]) == [0, 1, 2]  # CPU actors on one node: as placed


def test_ray_workers_on_other_machines_than_a_loopback_service_are_refused_in_one_line():
    """Workers on another machine could never reach a service listening on loopback (they would time out): one line
    naming them, `host` and the driver's address. Several Ray nodes on one machine share its address and pass."""
    from disttrain.errors import ConfigError
    from disttrain.service.ray_launcher import check_reachable

    with pytest.raises(ConfigError) as refused:
        check_reachable("127.0.0.1", "10.0.0.1", ["10.0.0.1", "10.0.0.2", "10.0.0.2"])
    message = str(refused.value)
    assert "worker(s) 1, 2 on other machines than this driver's (10.0.0.2)" in message and "\n" not in message
    assert "TrainingService.options(host=...)" in message and "Ray knows it as 10.0.0.1" in message
    check_reachable("127.0.0.1", "127.0.0.1", ["127.0.0.1", "127.0.0.1"])  # two Ray nodes on this machine
    check_reachable("10.0.0.1", "10.0.0.1", ["10.0.0.1", "10.0.0.2"])  # the user gave an address they can reach
    check_reachable("localhost", None, ["10.0.0.2"])  # a Ray client's driver: not on a node, nothing to compare
