"""The learning-rate schedule by name (`optim.schedule`), and your own optimizer left as it is."""

import pytest
import torch

from conftest import read_metrics
from disttrain import Trainer, load_config
from disttrain.config import ConfigError, OptimConfig, validate
from disttrain.optim import scheduler_factory


def _factors(cfg: OptimConfig, total: int, user_optimizer: bool = False) -> list[float] | None:
    make = scheduler_factory(cfg, total, user_optimizer)
    if make is None:
        return None
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler, factors = make(optimizer), []
    for _ in range(total):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return factors


def test_cosine_warms_up_then_decays_to_the_floor_and_constant_holds_the_peak():
    cosine = _factors(OptimConfig(schedule="cosine", warmup_steps=4, min_lr_ratio=0.1), 20)
    assert cosine[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(cosine[3:], cosine[4:], strict=False)) and cosine[-1] > 0.1
    assert _factors(OptimConfig(schedule="cosine", warmup_steps=4, min_lr_ratio=0.1), 40)[-1] < 0.12
    constant = _factors(OptimConfig(schedule="constant", warmup_steps=4), 20)
    assert constant[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and constant[4:] == [1.0] * 16


def test_auto_is_cosine_for_disttrains_optimizer_and_none_for_yours():
    assert _factors(OptimConfig(), 20) == _factors(OptimConfig(schedule="cosine"), 20)
    assert _factors(OptimConfig(), 20, user_optimizer=True) is None
    assert _factors(OptimConfig(schedule="none"), 20) is None
    assert _factors(OptimConfig(schedule="cosine"), 20, user_optimizer=True) is not None  # asked for: applied


def test_an_unknown_schedule_is_one_line():
    with pytest.raises(ConfigError, match="optim.schedule = 'linear' is not known"):
        validate(load_config(None, ["optim.schedule=linear"]))


@pytest.mark.parametrize("schedule, constant", [("auto", True), ("cosine", False)])
def test_a_user_optimizer_keeps_its_learning_rate_unless_a_schedule_is_asked_for(tmp_path, schedule, constant):
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16",
                             "data.global_batch_size=4", "data.micro_batch_size=4", "train.steps=5",
                             "train.eval_every=0", "log.progress=false", f"optim.schedule={schedule}",
                             f"run.out_dir={tmp_path}", "dist.threads_per_rank=1", "train.log_every=1"])
    Trainer(cfg, optimizer_factory=lambda model: torch.optim.SGD(model.parameters(), lr=0.05)).fit()
    rates = [m["lr"] for m in read_metrics(cfg.run_dir)]
    assert len(rates) == 5
    assert (rates == [0.05] * 5) is constant


def test_a_state_saved_without_the_empty_group_resumes_exactly():
    """The factory keeps both groups (matrices decayed, the rest), even empty: a bias-free model's second is empty.
    A state without it (saved under DeepSpeed, which drops empty groups, or before 2026-11-27) loads, the
    scheduler's per-group entries too, and training goes on as if uninterrupted."""
    import copy

    from disttrain.backend import create_backend
    from disttrain.config import ParallelConfig
    from disttrain.optim import optimizer_factory

    def backend():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 1, bias=False))
        cfg = OptimConfig(lr=0.05, warmup_steps=2)
        return create_backend(model, optimizer_factory(cfg), ParallelConfig(strategy="single"),
                              scheduler_factory=scheduler_factory(cfg, 10),
                              loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]))

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    batch = (x, x.sum(1, keepdim=True))

    def train(b, steps):
        for _ in range(steps):
            b.forward_backward(batch)
            b.optim_step()
        return [p.detach().clone() for p in b.model.parameters()]

    first = backend()
    assert [len(g["params"]) for g in first.optimizer.param_groups] == [2, 0]
    train(first, 3)
    state = copy.deepcopy(first.state_dict())
    expected = train(first, 2)
    state["optimizer"]["param_groups"] = state["optimizer"]["param_groups"][:1]  # the state as DeepSpeed saves it
    state["scheduler"] = {k: v[:1] if isinstance(v, list) else v for k, v in state["scheduler"].items()}
    resumed = backend()
    resumed.load_state_dict(state)
    assert [len(g["params"]) for g in resumed.optimizer.param_groups] == [2, 0]
    assert all(torch.equal(a, b) for a, b in zip(train(resumed, 2), expected, strict=True))
