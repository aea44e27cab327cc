import copy

import pytest
import torch

from disttrain.backend import create_backend
from disttrain.config import DistConfig, ModelConfig, OptimConfig, ParallelConfig
from disttrain.data import collate
from disttrain.models.gpt import GPT
from disttrain.optim import optimizer_factory
from disttrain.runtime import init_runtime

RUNTIME = None


def _runtime():
    global RUNTIME
    RUNTIME = RUNTIME or init_runtime(DistConfig(device="cpu", threads_per_rank=1), environ={})
    return RUNTIME


def _variable_length_batch(n: int, seed: int = 0) -> list[dict]:
    """Sequences of 3..16 tokens: padding differs wildly between micro-batches."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        length = int(torch.randint(3, 17, (1,), generator=g))
        seq = torch.randint(0, 256, (length + 1,), generator=g)
        items.append({"input_ids": seq[:-1], "labels": seq[1:]})
    return items


def _backend():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16))
    return create_backend(model, optimizer_factory(OptimConfig(lr=1e-2)), ParallelConfig(strategy="single"),
                          runtime=_runtime(), grad_clip=0.0)


def _accumulate(backend, items, micro: int) -> None:
    chunks = [items[i:i + micro] for i in range(0, len(items), micro)]
    for i, chunk in enumerate(chunks):
        backend.forward_backward(collate(chunk), sync=i == len(chunks) - 1)


def test_accumulation_normalises_by_valid_tokens_of_the_whole_batch():
    """micro-batch 2 x 4 accumulation == micro-batch 8 x 1, losses and gradients within 1e-6."""
    losses = {}
    for micro in (2, 8):
        backend = _backend()
        grads = []  # the gradients the optimizer sees, captured by a public step pre-hook
        params = list(backend.model.parameters())
        backend.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, grads=grads, params=params: grads.append([p.grad.clone() for p in params]))
        steps = []
        for step in range(3):
            _accumulate(backend, _variable_length_batch(8, seed=step), micro)
            steps.append(backend.optim_step()["loss"])
        losses[micro] = (steps, [g for step_grads in grads for g in step_grads])
    (steps_a, grads_a), (steps_b, grads_b) = losses[2], losses[8]
    assert steps_a == pytest.approx(steps_b, abs=1e-6)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_loss_is_token_mean_of_the_global_batch():
    backend = _backend()
    items = _variable_length_batch(4)
    with torch.no_grad():
        logits = backend.forward(collate(items))
        labels = collate(items)["labels"]
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    _accumulate(backend, items, micro=1)
    assert backend.optim_step()["loss"] == pytest.approx(expected.item(), abs=1e-6)


def test_optim_step_refuses_unsynced_last_micro_batch_and_empty_step():
    backend = _backend()
    with pytest.raises(RuntimeError, match="before any forward_backward"):
        backend.optim_step()
    backend.forward_backward(collate(_variable_length_batch(2)), sync=False)
    with pytest.raises(RuntimeError, match="sync=True on the last micro-batch"):
        backend.optim_step()


def test_mean_loss_functions_are_weighted_by_batch_size():
    """Micro-batches of 2 and 4 samples with a mean loss give the full-batch step of a plain loop."""
    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.1)

    x, y = torch.randn(6, 3), torch.randn(6, 1)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    backend = create_backend(model, sgd, runtime=_runtime(),
                             loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]))
    backend.forward_backward((x[:2], y[:2]), sync=False)
    backend.forward_backward((x[2:], y[2:]))
    loss = backend.optim_step()["loss"]

    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 1)
    full = torch.nn.functional.mse_loss(reference(x), y)
    full.backward()
    sgd(reference).step()
    assert loss == pytest.approx(full.item(), abs=1e-6)
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, ref, atol=1e-6, rtol=0)


def test_state_dict_round_trip_continues_identically():
    """AdamW's moments matter: a load that dropped them would continue with other parameters (the control
    below, a fresh optimizer on the same weights, shows the difference is visible)."""
    a = _backend()
    items = _variable_length_batch(4)
    for _ in range(2):
        _accumulate(a, items, 2)
        a.optim_step()
    # a copy, as a checkpoint read back from disk is: an in-memory state_dict() shares the optimizer's tensors,
    # and torch's Optimizer.load_state_dict keeps them shared (two backends would then update one moment)
    saved = copy.deepcopy(a.state_dict())
    b, control = _backend(), _backend()
    b.load_state_dict(saved)
    control.model.load_state_dict(saved["model"])
    got, want = b.optimizer.state_dict()["state"], a.optimizer.state_dict()["state"]
    assert want and got.keys() == want.keys()
    for key in want:
        assert want[key].keys() == got[key].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(got[key][name], want[key][name]) for name in want[key])
    for backend in (a, b, control):
        for _ in range(2):
            _accumulate(backend, items, 2)
            backend.optim_step()
    assert b.step == 4
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.model.parameters(), control.model.parameters(),
                                                          strict=True))


def test_strategy_and_precision_are_named_one_way_by_the_parallel_config():
    def build(*args, **kwargs):
        return create_backend(torch.nn.Linear(2, 1), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), *args,
                              runtime=_runtime(), **kwargs)

    assert build(ParallelConfig(precision="bf16-mixed")).precision.name == "bf16-mixed"
    assert build(ParallelConfig(precision="fp16-mixed")).precision.name == "fp16-mixed"
    assert build().precision.name == "fp32"
    with pytest.raises(TypeError):
        build(precision="fp32")  # no second spelling
    with pytest.raises(TypeError):
        build(strategy="single")


def test_compile_settings_it_cannot_run_are_refused_before_the_model_is_touched():
    """`create_backend` called from a user's own loop: an unknown torch.compile backend, or a split it does not
    compose with, is one line, and the model was not moved, wrapped or compiled."""
    from disttrain.errors import ConfigError

    model = GPT(ModelConfig(n_layer=2, d_model=32, n_head=2, seq_len=8))
    forwards = [block.forward for block in model.blocks]
    for parallel, message in ((ParallelConfig(compile="inductr", activation_checkpointing=True), "'inductr' is not"),
                              (ParallelConfig(compile="inductor", tensor=2), "with parallel.tensor = 2: compiled")):
        with pytest.raises(ConfigError, match=message):
            create_backend(model, optimizer_factory(OptimConfig()), parallel, runtime=_runtime())
    assert [block.forward for block in model.blocks] == forwards  # (not checkpointed)
    assert all(block._compiled_call_impl is None for block in model.blocks)


def test_a_strategy_that_needs_a_group_forms_it_under_torchrun_with_one_process(tmp_path):
    """`torchrun --nproc-per-node 1 script.py` with ddp: the group is formed at world size 1 (it used to fail
    with 'launch with --nproc N')."""
    import json

    from conftest import SCRIPTS, run_cli

    result = run_cli(["launch", "--fork", "--nproc", "1", "--run-dir", str(tmp_path / "launch"),
                      str(SCRIPTS / "one_rank_ddp.py")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if '"ddp"' in line)  # torchrun prefixes the rank
    report = json.loads(line[line.index("{"):])
    assert report["ddp"] and report["distributed"] and report["world"] == 1
    assert report["second"] < report["first"]


def test_a_step_that_needs_no_norm_skips_it_and_updates_the_same():
    """Without clipping, `optim_step(grad_norm=False)` skips the norm pass (NaN in the result) and applies the
    same update as a step that computes it."""
    import math

    items = _variable_length_batch(4)
    with_norm, without = _backend(), _backend()
    _accumulate(with_norm, items, 2)
    _accumulate(without, items, 2)
    measured, skipped = with_norm.optim_step(), without.optim_step(grad_norm=False)
    assert math.isfinite(measured["grad_norm"]) and measured["grad_norm"] > 0
    assert math.isnan(skipped["grad_norm"]) and not skipped["skipped"]
    for a, b in zip(with_norm.model.parameters(), without.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(with_norm.model.parameters(), _backend().model.parameters(),
                                                      strict=True))


def _clipped_backend(on_nonfinite: str = "stop", factory=None):
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16))
    return create_backend(model, factory or optimizer_factory(OptimConfig(lr=1e-2)), ParallelConfig(strategy="single"),
                          runtime=_runtime(), grad_clip=0.05, on_nonfinite=on_nonfinite)


def _snapshot(backend) -> list[torch.Tensor]:
    state = [t for s in backend.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in backend.model.parameters()] + [t.clone() for t in state]


def test_the_queued_step_updates_as_the_step_that_reads_the_device_first(monkeypatch):
    """torch's fused AdamW lets the step be queued whole (`steps_on_device`: clip coefficient and refusal stay on
    the device); the step that reads the totals and the norm first gives the same parameters and optimizer state,
    bit for bit, with clipping at work, and the same losses and norms."""
    queued, read = _clipped_backend(), _clipped_backend()
    assert queued.prepared.steps_on_device("cpu")
    monkeypatch.setattr(read.prepared, "steps_on_device", lambda device: False)
    results = {}
    for name, backend in (("queued", queued), ("read", read)):
        results[name] = []
        for step in range(3):
            _accumulate(backend, _variable_length_batch(8, seed=step), 4)
            out = backend.optim_step()
            results[name].append((out["loss"], out["grad_norm"], out["skipped"]))
    assert results["queued"] == results["read"]
    assert all(norm > 0.05 for _, norm, _ in results["read"])  # the clip was at work
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(queued), _snapshot(read), strict=True))


@pytest.mark.parametrize("bad", ["loss", "gradient"])
@pytest.mark.parametrize("implementation", ["fused", "foreach", "fused sgd"])
def test_a_refused_step_leaves_parameters_and_optimizer_state_as_they_were(bad, implementation):
    """A non-finite loss, or a finite loss with non-finite gradients, under train.on_nonfinite = 'skip': the step
    is skipped, the parameters and the optimizer's state (Adam's moments and step count; SGD's momentum) stay as
    they were (under the fused AdamW kernel, which skips on the device; under torch's foreach AdamW and under
    fused SGD, which would store momentum buffers it never filled, the host decides first), and the next step
    updates as in a run that never saw the bad batch."""
    def factory(model):
        if implementation == "fused sgd":
            return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
        return torch.optim.AdamW(model.parameters(), lr=1e-2, **{implementation: True})

    backend, reference = _clipped_backend("skip", factory), _clipped_backend("skip", factory)
    assert backend.prepared.steps_on_device("cpu") == (implementation == "fused")
    for b in (backend, reference):
        _accumulate(b, _variable_length_batch(8, seed=0), 4)
        b.optim_step()
    before = _snapshot(backend)
    items = _variable_length_batch(8, seed=1)
    if bad == "loss":
        backend.forward_backward(collate(items), loss_fn=lambda out, batch: out.float().mean() * float("nan"))
    else:
        handle = backend.model.tok_emb.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        backend.forward_backward(collate(items))
        handle.remove()
    out = backend.optim_step()
    assert out["skipped"] and out["skipped_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(backend), strict=True))
    for b in (backend, reference):
        _accumulate(b, _variable_length_batch(8, seed=2), 4)
        assert not b.optim_step()["skipped"]
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(backend), _snapshot(reference), strict=True))


@pytest.mark.parametrize("queued", [True, False])
def test_a_global_batch_with_no_valid_item_is_one_line_and_the_backend_goes_on(monkeypatch, queued):
    """Every label ignored (-100) in every micro-batch: one line, exit 2 (bad data, as bad config); the parameters
    and the optimizer's state are as they were, and the next step (its accumulators and gradients fresh) updates as
    in a run that never saw the empty batch, whether the step was queued on the device or read it first."""
    from disttrain.backend import EmptyBatchError
    from disttrain.errors import UserError

    backend, reference = _clipped_backend(), _clipped_backend()
    if not queued:
        monkeypatch.setattr(backend.prepared, "steps_on_device", lambda device: False)
        monkeypatch.setattr(reference.prepared, "steps_on_device", lambda device: False)
    for b in (backend, reference):
        _accumulate(b, _variable_length_batch(8, seed=0), 4)
        b.optim_step()
    before = _snapshot(backend)
    empty = [{**item, "labels": torch.full_like(item["labels"], -100)} for item in _variable_length_batch(8, seed=1)]
    _accumulate(backend, empty, 4)
    with pytest.raises(EmptyBatchError, match="step 2: the global batch has no valid items") as raised:
        backend.optim_step()
    assert isinstance(raised.value, UserError) and raised.value.exit_code == 2
    assert "\n" not in str(raised.value)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(backend), strict=True))
    assert all(p.grad is None for p in backend.model.parameters())
    for b in (backend, reference):
        _accumulate(b, _variable_length_batch(8, seed=2), 4)
        assert b.optim_step()["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(backend), _snapshot(reference), strict=True))


def test_a_loaded_state_keeps_the_optimizer_implementation_built_here():
    """A state saved by a foreach AdamW (as under DeepSpeed, whose optimizer is never fused) loads into a fused one
    without turning it into a foreach one (torch's load_state_dict takes the saved groups' flags), so its step
    is still queued whole; the moments are the saved ones."""
    saved = _clipped_backend(factory=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True))
    _accumulate(saved, _variable_length_batch(8), 4)
    saved.optim_step()
    loaded = _clipped_backend()
    loaded.load_state_dict(saved.state_dict())
    assert all(g["fused"] and not g["foreach"] for g in loaded.optimizer.param_groups)
    assert loaded.prepared.steps_on_device("cpu")
    for (name, a), b in zip(saved.model.named_parameters(), loaded.model.parameters(), strict=True):
        assert torch.equal(a, b), name
        mine, theirs = loaded.optimizer.state[b], saved.optimizer.state[a]
        assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq", "step")), name


def test_the_step_is_queued_only_where_every_parameter_is_on_the_device():
    """A parameter elsewhere (FSDP2's cpu_offload on a GPU keeps them on the host) would have the fused CPU kernel
    read the refusal flag before its copy from the device lands: that step reads the device first."""
    backend = _clipped_backend()
    assert backend.prepared.steps_on_device("cpu") and not backend.prepared.steps_on_device("meta")


@pytest.mark.parametrize("fused", [True, False])
def test_loaded_step_counts_are_placed_for_the_implementation_built_here(fused):
    """Where a fused (or capturable) group reads its step counts, on the parameter's device in float32, whatever
    the saved state's implementation put there; on the host otherwise (torch's rule for the saved group's flags,
    applied to the group as built). Shown with a parameter on the meta device."""
    from disttrain.backend import place_steps

    param = torch.nn.Parameter(torch.empty(3, device="meta"))
    optimizer = torch.optim.AdamW([param], lr=1e-2)
    group = {**optimizer.param_groups[0], "fused": fused}
    optimizer.state[param] = {"step": torch.tensor(7.0, dtype=torch.float64)}  # where a foreach state keeps it
    place_steps(optimizer, group)
    step = optimizer.state[param]["step"]
    assert (step.device.type, step.dtype) == (("meta", torch.float32) if fused else ("cpu", torch.float64))
