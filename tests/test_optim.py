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


def _train(backend, steps: int) -> list[torch.Tensor]:
    """`steps` steps of a sum-regression batch; the parameters after them."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        backend.forward_backward((x, x.sum(1, keepdim=True)))
        backend.optim_step()
    return [p.detach().clone() for p in backend.model.parameters()]


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

    first = backend()
    assert [len(g["params"]) for g in first.optimizer.param_groups] == [2, 0]
    _train(first, 3)
    state = copy.deepcopy(first.state_dict())
    expected = _train(first, 2)
    state["optimizer"]["param_groups"] = state["optimizer"]["param_groups"][:1]  # the state as DeepSpeed saves it
    state["scheduler"] = {k: v[:1] if isinstance(v, list) else v for k, v in state["scheduler"].items()}
    resumed = backend()
    resumed.load_state_dict(state)
    assert [len(g["params"]) for g in resumed.optimizer.param_groups] == [2, 0]
    assert all(torch.equal(a, b) for a, b in zip(_train(resumed, 2), expected, strict=True))


def test_align_groups_fits_a_state_that_differs_by_empty_groups_only():
    """Saved longer (torch-native, into DeepSpeed's filtered optimizer), shorter (DeepSpeed's or an old state, into
    the factory's), into a stage with nothing to train, with a SequentialLR's nested per-group lists; otherwise
    unchanged."""
    from disttrain.optim import align_groups

    def groups(*sizes, wd=(0.1, 0.0, 0.2)):
        return [{"params": [f"p{i}{j}" for j in range(n)], "weight_decay": wd[i], "lr": 1.0}
                for i, n in enumerate(sizes)]

    saved = groups(2, 0, 1)  # the factory's, the middle one empty
    lambdas = {"base_lrs": [1.0, 2.0, 3.0], "_last_lr": [0.1, 0.2, 0.3], "last_epoch": 4}
    ds = groups(2, 1, wd=(0.1, 0.2))  # DeepSpeed dropped the empty one
    fitted, sched = align_groups(ds, {"param_groups": saved}, lambdas, {"base_lrs": [9, 9], "_last_lr": [9, 9]})
    assert [g["params"] for g in fitted["param_groups"]] == [["p00", "p01"], ["p20"]]
    assert sched == {"base_lrs": [1.0, 3.0], "_last_lr": [0.1, 0.3], "last_epoch": 4}
    fitted, sched = align_groups(saved, {"param_groups": ds}, {"base_lrs": [1.0, 3.0], "last_epoch": 4},
                                 {"base_lrs": [7, 8, 9]})
    assert [(g["params"], g["weight_decay"]) for g in fitted["param_groups"]] == \
        [(["p00", "p01"], 0.1), ([], 0.0), (["p10"], 0.2)]
    assert sched == {"base_lrs": [1.0, 8, 3.0], "last_epoch": 4}
    stage = groups(0, 0, 0)  # a pipeline stage with nothing to train: its own groups, the saved scalars
    fitted, sched = align_groups(stage, {"param_groups": ds}, {"base_lrs": [1.0, 3.0], "last_epoch": 4},
                                 {"base_lrs": [7, 8, 9], "last_epoch": 0})
    assert [g["params"] for g in fitted["param_groups"]] == [[], [], []] and sched["last_epoch"] == 4
    assert sched["base_lrs"] == [7, 8, 9]
    nested = {"_schedulers": [{"base_lrs": [1.0, 3.0]}, {"base_lrs": [5.0, 6.0]}], "_milestones": [2]}
    own = {"_schedulers": [{"base_lrs": [7, 8, 9]}, {"base_lrs": [7, 8, 9]}], "_milestones": [2]}
    _, sched = align_groups(saved, {"param_groups": ds}, nested, own)
    assert sched["_schedulers"] == [{"base_lrs": [1.0, 8, 3.0]}, {"base_lrs": [5.0, 8, 6.0]}]
    other = {"param_groups": groups(2, 1)}  # groups made otherwise: torch's load maps them by parameter name
    assert align_groups(groups(2, 1, 1), other, lambdas, {}) == (other, lambdas)


def test_several_empty_groups_resume_under_a_torch_native_strategy():
    """torch's set_state_dict places at most one empty group: a user's per-block groups with two of them frozen
    resume all the same, to the uninterrupted run's parameters."""
    import copy

    from disttrain.backend import create_backend
    from disttrain.config import ParallelConfig

    def backend():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        model[0].requires_grad_(False)
        model[1].requires_grad_(False)
        return create_backend(model, lambda m: torch.optim.AdamW(
            [{"params": [p for p in block.parameters() if p.requires_grad], "lr": 0.01 * (i + 1)}
             for i, block in enumerate(m)]), ParallelConfig(strategy="single"),
            loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]))

    first = backend()
    _train(first, 2)
    state = copy.deepcopy(first.state_dict())
    expected = _train(first, 2)
    resumed = backend()
    resumed.load_state_dict(state)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [0.01, 0.02, 0.03]
    assert all(torch.equal(a, b) for a, b in zip(_train(resumed, 2), expected, strict=True))


def test_a_schedule_of_other_groups_is_refused_at_load():
    """A state saved with another optimizer (one group, not the factory's two, neither empty): torch's load maps
    the optimizer's state by name, but the schedule's per-group lists cannot be: one line at load, not a failure
    at the first step after it."""
    from disttrain.backend import create_backend
    from disttrain.config import ParallelConfig
    from disttrain.errors import ConfigError
    from disttrain.optim import optimizer_factory

    cfg = OptimConfig(lr=0.05, warmup_steps=2)

    def backend(factory):
        torch.manual_seed(0)
        return create_backend(torch.nn.Linear(4, 1), factory, ParallelConfig(strategy="single"),
                              scheduler_factory=scheduler_factory(cfg, 10))

    saved = backend(lambda m: torch.optim.AdamW(m.parameters(), lr=0.05)).state_dict()
    with pytest.raises(ConfigError, match="schedule covers 1 parameter groups and this optimizer has 2"):
        backend(optimizer_factory(cfg)).load_state_dict(saved)
