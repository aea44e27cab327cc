"""A small policy-gradient (REINFORCE) loop on a toy task, trained through the TrainingService.

The task: a contextual bandit. Each episode shows one of 8 contexts; the policy picks one of 4 actions
and earns reward 1 for the context's right action (context % 4), else 0. Random play earns 0.25.

The loop stays here, in the driver: roll out with `service.forward` (the workers run the policy), score,
then `forward_backward` with a custom loss (`policy_gradient_loss`, run inside the workers, which whitens
the advantages over all ranks with `disttrain.collectives.whiten`), then `optim_step`.

    python examples/rl_loop.py                      # 2 local worker processes
    python examples/rl_loop.py --launcher ray        # 2 Ray actors (pip install 'disttrain[ray]')
"""

from __future__ import annotations

import argparse
import asyncio
import json

import torch
from torch import nn

N_CONTEXTS, N_ACTIONS = 8, 4


def build_policy(hidden: int = 32) -> nn.Module:
    """The policy: one-hot context -> action logits (built inside every worker from this import path)."""
    return nn.Sequential(nn.Linear(N_CONTEXTS, hidden), nn.Tanh(), nn.Linear(hidden, N_ACTIONS))


def policy_gradient_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]):
    """REINFORCE with whitened advantages: -sum(log pi(a|s) * A), and the number of episodes.

    Runs on each worker with its slice of the batch; `whiten` uses the mean and std of the *global*
    batch (one all-reduce), so the result does not depend on how many workers there are."""
    from disttrain.collectives import whiten

    advantages = whiten(batch["advantages"].float())
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(1, batch["actions"].long()[:, None])[:, 0]
    return -(log_probs * advantages).sum(), len(advantages)


def rollout(logits: torch.Tensor, contexts: torch.Tensor, generator: torch.Generator):
    actions = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
    rewards = (actions == contexts % N_ACTIONS).float()
    return actions, rewards


async def main(args: argparse.Namespace) -> dict:
    from disttrain.service import TrainingService

    service = await TrainingService.options(nproc=args.nproc, launcher=args.launcher, threads_per_rank=1).as_service(
        "rl_loop:build_policy", optimizer={"lr": args.lr, "weight_decay": 0.0, "warmup_steps": 0},
        grad_clip=0.0, strategy=args.strategy, seed=0)
    generator = torch.Generator().manual_seed(0)
    rewards_seen = []
    try:
        for it in range(1, args.iters + 1):
            contexts = torch.randint(0, N_CONTEXTS, (args.episodes,), generator=generator)
            obs = nn.functional.one_hot(contexts, N_CONTEXTS).float()
            logits = await service.forward({"inputs": obs})
            actions, rewards = rollout(logits, contexts, generator)
            await service.forward_backward({"inputs": obs, "actions": actions, "advantages": rewards},
                                           loss_fn="rl_loop:policy_gradient_loss")
            await service.optim_step()
            rewards_seen.append(rewards.mean().item())
            if it % 10 == 0 or it == 1:
                print(f"iteration {it:4d}  mean reward {rewards_seen[-1]:.3f}", flush=True)
    finally:
        await service.shutdown()
    window = max(1, len(rewards_seen) // 5)
    return {"first_reward": sum(rewards_seen[:window]) / window, "last_reward": sum(rewards_seen[-window:]) / window,
            "iterations": len(rewards_seen), "launcher": args.launcher, "nproc": args.nproc}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", default="local", choices=["local", "ray"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--episodes", type=int, default=64, help="episodes per iteration (the global batch)")
    parser.add_argument("--lr", type=float, default=0.05)
    result = asyncio.run(main(parser.parse_args()))
    print(json.dumps(result))
