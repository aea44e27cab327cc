"""GRPO on a small Hugging Face model: a TrainingService trains, a separate inference worker rolls out, and the
weights go from the trainer's ranks to the inference worker every iteration (weight sync).

The task (a toy reward): after a prompt of random tokens the policy writes `--completion` tokens and earns the
fraction of them that are "small" (token id < 8 of a 64-token vocabulary). A random policy earns about 1/8.

Each iteration:
1. the inference worker (a process forked before anything else starts: `disttrain.service.fork.Worker`) samples
   `--group` completions for each of `--prompts` prompts with the weights it holds;
2. the driver scores them and computes GRPO's advantages: each reward minus its group's mean, over the group's
   standard deviation;
3. the service runs `forward_backward` with `grpo_loss` (inside the workers: the advantage-weighted log-likelihood
   of the completion tokens, token-summed, so ranks and micro-batches do not change it) and `optim_step`;
4. `sync.push()` streams the new weights (bf16, as a delta after the first version) from every rank to the inference
   worker, which acknowledges the version before the next rollout.

    python examples/grpo_hf.py                 # 2 local fsdp workers, 1 inference worker
    python examples/grpo_hf.py --iters 30 --strategy ddp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile

import torch

VOCAB, SMALL = 64, 8


def tiny_llama(directory: str) -> None:
    """A randomly initialised 2-layer Llama saved with save_pretrained (nothing is downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(directory)


def grpo_loss(outputs, batch: dict[str, torch.Tensor]):
    """-sum(advantage x log pi(token)) over completion tokens, and their count (runs inside the workers)."""
    from disttrain.losses import logits_of

    logits = logits_of(outputs)[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    mask = batch["completion_mask"][:, 1:].float()
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
    return -(log_probs * batch["advantages"][:, None] * mask).sum(), mask.sum()


def inference_worker(conn) -> int:
    """The rollout engine: holds a copy of the policy, takes each version from the trainer, samples completions."""
    from transformers import LlamaForCausalLM

    from disttrain.service.weights import WeightReceiver

    torch.set_num_threads(1)
    model = receiver = None
    while True:
        message, tensors = conn.recv()
        if message["op"] == "connect":
            model = LlamaForCausalLM.from_pretrained(message["model_dir"], dtype=torch.float32).eval()
            receiver = WeightReceiver(message["endpoint"], "rollout")
            conn.send({"ok": True})
        elif message["op"] == "sync":
            version = receiver.receive(timeout_s=120)
            receiver.load_into(model)
            conn.send({"version": version})
        elif message["op"] == "rollout":
            ids = tensors["prompts"]
            generator = torch.Generator().manual_seed(message["seed"])
            with torch.no_grad():
                for _ in range(message["length"]):
                    probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
                    ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
            conn.send({"version": receiver.version}, {"sequences": ids})
        else:
            receiver.close()
            return 0


async def main(args: argparse.Namespace) -> dict:
    from disttrain.service import TrainingService
    from disttrain.service.fork import Worker

    torch.set_num_threads(1)
    engine = Worker(inference_worker)  # forked first, while the driver has no threads (saving a model starts some)
    model_dir = tempfile.mkdtemp(prefix="grpo_llama_")
    tiny_llama(model_dir)
    service = await TrainingService.options(nproc=args.nproc, threads_per_rank=1).as_service(
        f"hf:{model_dir}", loss_fn="grpo_hf:grpo_loss", strategy=args.strategy, seed=0, grad_clip=1.0,
        optimizer={"lr": args.lr, "weight_decay": 0.0, "warmup_steps": 0})
    generator = torch.Generator().manual_seed(1)
    rewards_seen, synced = [], []
    try:
        sync = await service.weight_sync(consumers=1, dtype="bfloat16", timeout_s=120)
        engine.send({"op": "connect", "endpoint": sync.endpoint, "model_dir": model_dir})
        engine.recv()
        for it in range(1, args.iters + 1):
            engine.send({"op": "sync"})
            report = await sync.push(delta=it > 1)  # the engine acknowledges before push returns
            synced.append({"version": engine.recv()[0]["version"], "bytes": report["bytes"]})
            prompts = torch.randint(SMALL, VOCAB, (args.prompts, 4), generator=generator)
            engine.send({"op": "rollout", "seed": it, "length": args.completion},
                        {"prompts": prompts.repeat_interleave(args.group, dim=0)})
            reply, tensors = engine.recv()
            assert reply["version"] == sync.version  # rolled out with the weights just trained
            sequences = tensors["sequences"]
            completion = sequences[:, prompts.shape[1]:]
            rewards = (completion < SMALL).float().mean(dim=1)
            grouped = rewards.view(args.prompts, args.group)
            advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
            mask = torch.zeros_like(sequences)
            mask[:, prompts.shape[1]:] = 1
            await service.forward_backward({"input_ids": sequences, "completion_mask": mask,
                                            "advantages": advantages.flatten()})
            await service.optim_step()
            rewards_seen.append(rewards.mean().item())
            print(f"iteration {it:3d}  weights v{synced[-1]['version']} ({synced[-1]['bytes'] / 1e3:,.0f} kB)  "
                  f"mean reward {rewards_seen[-1]:.3f}", flush=True)
    finally:
        engine.send({"op": "stop"})
        engine.wait()
        await service.shutdown()
    window = max(1, len(rewards_seen) // 4)
    return {"first_reward": sum(rewards_seen[:window]) / window, "last_reward": sum(rewards_seen[-window:]) / window,
            "iterations": len(rewards_seen), "versions": [s["version"] for s in synced],
            "sync_bytes": [s["bytes"] for s in synced]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO's group)")
    parser.add_argument("--completion", type=int, default=8, help="tokens per completion")
    parser.add_argument("--lr", type=float, default=3e-3)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
