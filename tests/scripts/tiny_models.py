"""A user model module for `model.name = "tiny_models:bigram"` tests."""

import torch


class Bigram(torch.nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, idx):
        return self.table(idx)


def bigram(model_config):
    return Bigram(model_config.vocab_size)


def not_a_module(model_config):
    return "oops"


class BigramWithBallast(Bigram):
    """A bigram model carrying 64 MiB of frozen weights: training stays fast, saving takes a while."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.ballast = torch.nn.Parameter(torch.zeros(16 * 2**20), requires_grad=False)


def bigram_with_ballast(model_config):
    return BigramWithBallast(model_config.vocab_size)


class Faulty(Bigram):
    """A bigram model that misbehaves on one rank at one training step (set by the environment):
    FAULT=raise|sleep|oom, FAULT_RANK, FAULT_STEP (counted in training forwards of one micro-batch each)."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.calls = 0

    def forward(self, idx):
        import os
        import time

        self.calls += self.training
        env = os.environ
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if (self.training and env.get("RANK", "0") == env.get("FAULT_RANK", "1")
                and self.calls == int(env.get("FAULT_STEP", "7")) and attempt < int(env.get("FAULT_ATTEMPTS", "99"))):
            fault = os.environ.get("FAULT", "raise")
            if fault == "sleep":
                time.sleep(10_000)
            if fault == "oom":
                raise torch.OutOfMemoryError("injected: cannot allocate 64 GiB")
            raise ValueError(f"injected failure at step {self.calls}")
        return super().forward(idx)


def faulty(model_config):
    return Faulty(model_config.vocab_size)
