"""A strategy of the tests' own, registered from outside disttrain: data parallelism written by hand (rank 0's
weights broadcast, gradients summed with one all_reduce per parameter after the last backward of a step)."""

import torch.distributed as dist

from disttrain.parallel import Prepared, StrategySpec
from disttrain.parallel.layout import replicated


class HandReduced(Prepared):
    def backward(self, loss, sync):
        loss.backward()
        if sync:  # accumulation micro-batches keep their gradients local, the last one sums them over ranks
            for param in self.model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)


def apply(model, runtime, cfg):
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, 0)
    return HandReduced(module=model, model=model)  # gradients are sums over ranks: grads_averaged_over = 1


SPECS = (StrategySpec("toy_allreduce", apply, "test only: gradients all-reduced by hand after backward", replicated),)
