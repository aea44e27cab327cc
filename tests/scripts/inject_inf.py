"""fp16 loss scaling under a distributed strategy: an inf injected into ONE rank's gradients must make every
rank skip that step and halve the scale. Each rank writes OUT/<strategy>_rank<R>.json.

    disttrain launch --nproc 2 inject_inf.py OUT ddp fsdp zero1 deepspeed

The inf goes into rank 1's gradients after backward; under deepspeed (ZeRO-2), whose engine holds the
gradients in buffers of its own, into rank 1's gradient of one parameter during backward, before reduction.
"""

import json
import sys
from pathlib import Path

import torch

from disttrain.backend import create_backend
from disttrain.checkpoint import CheckpointManager
from disttrain.config import DistConfig, ModelConfig, OptimConfig, ParallelConfig
from disttrain.models.gpt import GPT
from disttrain.optim import optimizer_factory
from disttrain.runtime import exit_process, init_runtime, shutdown


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run(strategy: str, runtime, out: Path) -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16))
    backend = create_backend(model, optimizer_factory(OptimConfig(lr=1e-3)),
                             ParallelConfig(strategy=strategy, precision="fp16-mixed"), runtime=runtime)
    g = torch.Generator().manual_seed(runtime.rank)
    records, clean_steps, injected = [], 0, None
    for step in range(1, 40):
        x = torch.randint(0, 256, (4, 17), generator=g)
        inject = injected is None and clean_steps >= 2  # the scale has settled: inject now, on rank 1 only
        hook = None
        if inject and runtime.rank == 1 and strategy == "deepspeed":
            hook = next(backend.model.parameters()).register_hook(
                lambda grad: grad.index_fill(0, torch.zeros(1, dtype=torch.long, device=grad.device), float("inf")))
        backend.forward_backward({"input_ids": x[:, :-1], "labels": x[:, 1:]})
        if hook is not None:
            hook.remove()
        if inject:
            injected = step
            if runtime.rank == 1 and strategy != "deepspeed":
                param = next(p for p in backend.model.parameters() if p.grad is not None and local(p.grad).numel())
                local(param.grad).view(-1)[0] = float("inf")
        before = [local(p).detach().clone() for p in backend.model.parameters()]
        result = backend.optim_step()
        changed = any(not torch.equal(b, local(p)) for b, p in zip(before, backend.model.parameters(), strict=True))
        records.append({"step": step, "skipped": result["skipped"], "scale": result["loss_scale"], "changed": changed})
        clean_steps = 0 if result["skipped"] else clean_steps + 1
        if injected is not None and step == injected + 1:
            break
    manager = CheckpointManager(out / f"ckpt_{strategy}", runtime=runtime)  # save/resume through the manager
    manager.save(backend.step, backend.state_dict())
    restored = create_backend(GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)),
                              optimizer_factory(OptimConfig(lr=1e-3)),
                              ParallelConfig(strategy=strategy, precision="fp16-mixed"), runtime=runtime)
    restored.load_state_dict(manager.load())
    (out / f"{strategy}_rank{runtime.rank}.json").write_text(json.dumps({
        "injected": injected, "records": records, "restored_scale": restored.scaler.get_scale(),
        "restored_skipped": restored.skipped_steps}))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    runtime = init_runtime(DistConfig(threads_per_rank=1, timeout_s=120))
    for strategy in sys.argv[2:]:
        run(strategy, runtime, out)
    shutdown(runtime)
    exit_process(0)
