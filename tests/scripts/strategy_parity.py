"""Train the same small GPT job under several strategies in one process group (one launch, many runs).

    python strategy_parity.py OUT single
    disttrain launch --nproc 2 strategy_parity.py OUT ddp zero2 fsdp+ac hsdp:1 deepspeed+stage3 ...

A variant is `strategy[+flag...][:hsdp_shard_size]`, flags: `ac` (activation checkpointing), `offload`
(cpu_offload), `prefetchN` (fsdp_prefetch=N), `stageN` (deepspeed_stage=N), `bf16` (bf16-mixed), `fp16` (fp16-mixed),
`sgd` (optim.name=sgd), `noclip` (optim.grad_clip=0), `gcfp16` / `gcbf16` / `powersgd` (parallel.grad_compression),
`tinybuckets` (parallel.bucket_cap_mb=0.01: many DDP buckets), `tpN` (parallel.tensor=N), `sp` (sequence parallel),
`lp` (parallel.loss_parallel=true: the loss on logits split by vocabulary),
`ppN` (parallel.pipeline=N), `gpipe` / `1f1b` / `i1f1b` / `zb` / `zbv` / `dualpipev` (parallel.pipeline_schedule),
`vN` (parallel.pipeline_stages_per_rank=N), `compile` / `inductor` (parallel.compile=aot_eager / inductor),
`layersN` (model.n_layer=N), `mbN` (data.micro_batch_size=N), `cpN` (parallel.context=N), `freeze` (model.freeze:
the embeddings and the first block, i.e. the first pipeline stage, do not train), `freezevec` (model.freeze: the
biases and norms, so that the optimizer's group of them is empty), `freezeboth` (the two; all three `FROZEN`),
`devtimed`
(communication metered as on CUDA: parallel/comm.py's device-timed DDP hook and asynchronous FSDP collectives, here
over gloo, which times nothing on a device).
An argument with `=` is a setting for every variant (e.g. `model.name=hf:DIR` trains a Hugging Face model).
`A>B` trains A to half of train.steps (step 10 of 20) with a checkpoint there, then resumes it under B to the end
(its losses are steps 11-20). `variant@label` runs the variant under another name (e.g. twice, with different settings).
The strategy `plain` (1 process only) is not disttrain but the plain-torch loop of
plain_reference.py on the same job. Rank 0 writes OUT/<world>.json: {variant: {"losses": [...],
"grad_norms": [...], "eval": {...}, "graphs": N, "activations": A}} (N: graphs torch.compile made, in both runs of A>B;
0 without `parallel.compile`; A: under inductor, `compiled_activations`, else null) and each variant's final
parameters to OUT/<world>/<variant>.safetensors (under a pipeline, rank 0's stage; the other ranks' in
<variant>.rank<R>.safetensors). Under tensor parallelism
each rank also writes the pieces it would send in a weight sync to OUT/<world>/pieces/<run name>.rank<R>.safetensors.
"""

import json
import sys
from pathlib import Path

import plain_reference
import torch
from safetensors.torch import save_file

from disttrain import Trainer, load_config
from disttrain.parallel import comm
from disttrain.runtime import exit_process, init_runtime, shutdown

JOB = ["model.n_layer=2", "model.d_model=64", "model.seq_len=32", "data.global_batch_size=16",
       "data.micro_batch_size=4", "train.steps=20", "train.eval_every=10", "train.eval_samples=33",
       "log.progress=false", "dist.threads_per_rank=1", "dist.timeout_s=120", "train.log_every=1"]


FLAGS = {"ac": "parallel.activation_checkpointing=true", "offload": "parallel.cpu_offload=true",
         "prefetch": "parallel.fsdp_prefetch={}", "stage": "parallel.deepspeed_stage={}",
         "bf": "parallel.precision=bf{}-mixed", "fp": "parallel.precision=fp{}-mixed", "sgd": "optim.name=sgd",
         "noclip": "optim.grad_clip=0", "gcfp": "parallel.grad_compression=fp{}",
         "gcbf": "parallel.grad_compression=bf{}", "powersgd": "parallel.grad_compression=powersgd",
         "tinybuckets": "parallel.bucket_cap_mb=0.01", "tp": "parallel.tensor={}",
         "sp": "parallel.sequence_parallel=true", "lp": "parallel.loss_parallel=true",
         "pp": "parallel.pipeline={}",
         "gpipe": "parallel.pipeline_schedule=gpipe", "1f1b": "parallel.pipeline_schedule=1f1b",
         "i1f1b": "parallel.pipeline_schedule=interleaved-1f1b", "zb": "parallel.pipeline_schedule=zero-bubble",
         "zbv": "parallel.pipeline_schedule=zbv", "dualpipev": "parallel.pipeline_schedule=dualpipev",
         "v": "parallel.pipeline_stages_per_rank={}",
         "layers": "model.n_layer={}", "mb": "data.micro_batch_size={}", "cp": "parallel.context={}",
         "compile": "parallel.compile=aot_eager", "inductor": "parallel.compile=inductor"}
FROZEN = {"freeze": {"gpt": "tok_emb.*,pos_emb.*,blocks.0.*", "hf": "model.embed_tokens.*,model.layers.0.*"},
          "freezevec": {"gpt": "*.bias,*ln*", "hf": "*norm*"},
          "freezeboth": {"gpt": "tok_emb.*,pos_emb.*,blocks.0.*,*.bias,*ln*"}}
"""model.freeze of the `freeze` flags, by the model's names: the reference GPT's, or a Hugging Face Llama's."""


def overrides(variant: str) -> list[str]:
    name, _, shard = variant.partition(":")
    strategy, *flags = name.split("+")
    out = [f"parallel.strategy={strategy}"]
    for flag in (f for f in flags if f != "devtimed"):
        key = flag.rstrip("0123456789")
        if key in FROZEN:
            hf = any(setting.startswith("model.name=hf:") for setting in SETTINGS)
            out.append(f"model.freeze={FROZEN[key]['hf' if hf else 'gpt']}")
            continue
        out.append(FLAGS[key].format(flag[len(key):]))
    return out + ([f"parallel.hsdp_shard_size={shard}"] if shard else [])


def plain_tensor(t) -> torch.Tensor:
    """A fresh float32 CPU copy of a full (gathered, for a DTensor) tensor; tied weights no longer share storage."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return torch.tensor(t.detach().cpu().float().numpy())


def train(out: Path, runtime, name: str, variant: str, extra: list[str]) -> tuple[dict, dict]:
    """(losses, grad norms, eval losses; the final parameters) of one variant."""
    cfg = load_config(None, [*JOB, *SETTINGS, f"run.out_dir={out}", f"run.name={name}", *overrides(variant), *extra])
    if cfg.parallel.strategy == "plain":
        ref = plain_reference.from_config(cfg)
        return {"losses": ref.losses, "grad_norms": ref.grad_norms, "eval": {}, "graphs": 0}, ref.params
    comm.meter_for = device_meter if "+devtimed" in variant else METER_FOR
    if cfg.parallel.compile:  # (the jobs before compiled the same blocks' code: their graphs would count against
        torch._dynamo.reset()  # dynamo's recompile limit; past it dynamo would run the blocks eagerly: fail instead)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] if cfg.parallel.compile else 0
    trainer = Trainer(cfg, runtime=runtime)
    result = trainer.fit()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs if cfg.parallel.compile else 0
    # collectives under sharded strategies (the state dict, gathering its shards): every rank calls them
    params = {k: plain_tensor(v) for k, v in trainer.backend.state_dict()["model"].items()}
    if "+tp" in variant and runtime.world_size > 1:  # tensor shards, and FSDP's strided shards of them
        dump_pieces(out / str(runtime.world_size) / "pieces" / f"{name}.rank{runtime.rank}.safetensors", trainer, cfg,
                    runtime)
    saved = compiled_activations(cfg, runtime) if cfg.parallel.compile == "inductor" and runtime.world_size == 1 \
        else None
    return {"losses": result.losses, "grad_norms": result.grad_norms, "eval": result.eval_losses,
            "graphs": graphs, "activations": saved}, params


def compiled_activations(cfg, runtime) -> list[list[int]]:
    """[measured, estimated] bytes of activations a step of one micro-batch saves for backward, without and with
    activation checkpointing (memory.measure, on a backend of `cfg` built afresh: the compiled blocks' graphs, as
    inductor's partitioner chose what to save; memory.estimate counts what the eager blocks save)."""
    from dataclasses import replace

    from disttrain.backend import create_backend
    from disttrain.memory import estimate, measure
    from disttrain.models import build_model, vocab_size
    from disttrain.optim import optimizer_factory

    torch._dynamo.reset()  # (graphs of its own, whatever the training run left in dynamo's cache)
    x = torch.randint(0, vocab_size(cfg.model), (cfg.data.micro_batch_size, cfg.model.seq_len))
    sizes = []
    for checkpointed in (False, True):
        one = replace(cfg, parallel=replace(cfg.parallel, activation_checkpointing=checkpointed))
        got = measure(lambda one=one: create_backend(build_model(one.model), optimizer_factory(one.optim),
                                                     one.parallel, runtime=runtime), {"input_ids": x, "labels": x})
        want = estimate(one, 1)
        sizes.append([got["activations"], want.activations_ac if checkpointed else want.activations])
    return sizes


def dump_pieces(path: Path, trainer, cfg, runtime) -> None:
    """What this rank sends in a weight sync (service/weights/pieces.py `local_pieces`), as `NAME@OFFSETS` tensors, with
    the tied names (aliases) and full shapes in the file's metadata. Collective: every rank calls it."""
    from disttrain.parallel import registry
    from disttrain.parallel.mesh import layout_for
    from disttrain.service.weights import local_pieces

    layout = layout_for(cfg.parallel, runtime.world_size, registry.resolve(cfg.parallel.strategy, runtime.world_size))
    pieces = local_pieces(trainer.backend.model, layout, runtime.rank)
    tensors = {f"{p.name}@{','.join(map(str, p.offset))}": plain_tensor(p.local) for p in pieces if p.alias is None}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path, metadata={"aliases": json.dumps({p.name: p.alias for p in pieces if p.alias}),
                                       "shapes": json.dumps({p.name: p.shape for p in pieces})})


SETTINGS: list[str] = []
METER_FOR = comm.meter_for


def device_meter(device, compression: str = "none"):
    return None if compression == "powersgd" else comm.CommMeter(on_device=True)


def main() -> None:
    out = Path(sys.argv[1])
    SETTINGS.extend(a for a in sys.argv[2:] if "=" in a)
    variants = [a for a in sys.argv[2:] if "=" not in a]
    runtime = init_runtime(load_config(None, JOB).dist)
    results = {}
    for variant in variants:
        first, _, then = variant.split("@")[0].partition(">")
        name = variant.replace(":", "_").replace(">", "_to_").replace("@", "_")
        if then:  # the second run resumes the first's checkpoint (same run dir, checkpoint.resume = auto)
            half = load_config(None, [*JOB, *SETTINGS]).train.steps // 2
            before, _ = train(out, runtime, name, first, [f"checkpoint.every={half}", f"train.stop_at={half}"])
            results[variant], params = train(out, runtime, name, then, [f"checkpoint.every={half}"])
            results[variant]["graphs"] += before["graphs"]
        else:
            results[variant], params = train(out, runtime, name, first, [])
        folder = out / str(runtime.world_size)
        if runtime.is_main_process():
            folder.mkdir(exist_ok=True)
            save_file(params, folder / f"{variant}.safetensors")
        elif "+pp" in variant:  # a pipeline stage holds its own parameters: every rank writes its part
            folder.mkdir(exist_ok=True)
            save_file(params, folder / f"{variant}.rank{runtime.rank}.safetensors")
    if runtime.is_main_process():
        (out / f"{runtime.world_size}.json").write_text(json.dumps(results))
    shutdown(runtime)


if __name__ == "__main__":
    main()
    exit_process(0)
