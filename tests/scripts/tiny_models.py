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
