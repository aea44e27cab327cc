"""The published scaling results the scale model is checked against (`disttrain bench predict --validate`, and
tests/test_scale_model.py): each case is the workload and interconnect of a published run, its per-GPU throughput
ratio between two GPU counts, and the tolerance the prediction must meet. Pure Python, as scale_model."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.bench.interconnect import PRESETS
from disttrain.bench.model_shapes import MODELS
from disttrain.bench.scale_model import (
    H100_BF16_TFLOPS,
    Prediction,
    Workload,
    compute_seconds,
    predict,
)


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    strategy: str
    model: str
    interconnect: str
    gpus: tuple[int, int]
    """(base, scaled) GPU counts."""
    efficiency: float
    """Published per-GPU throughput at the scaled count / at the base count."""
    tolerance: float
    """How far the prediction may be from it (stated with the case)."""
    local_batch: int
    precision: str
    shape: str = ""
    """For a result published only in words: the words; efficiency +- tolerance is then the band they are read as."""
    compute_s: float = 0.0
    """One GPU's step compute; 0 = from FLOPs at `mfu` of the H100's bf16 peak."""
    mfu: float = 0.0
    assumptions: str = ""

    def workload(self) -> Workload:
        model = MODELS[self.model]
        tokens = self.local_batch * max(model.seq_len, 1)
        compute = self.compute_s or compute_seconds(model, tokens, H100_BF16_TFLOPS, self.mfu)
        return Workload(model, compute, tokens, self.precision, log_every=0)  # (no disttrain figures to gather)

    def predicted(self) -> list[Prediction]:
        return predict(self.strategy, list(self.gpus), self.workload(), PRESETS[self.interconnect])


PUBLISHED = (
    Published("torchtitan Llama 3.1 8B, FSDP, H100: 8 -> 128 GPUs",
              "pytorch/torchtitan docs/performance.md, Tables 1 and 3: 5,762 -> 5,605 tokens/s per GPU",
              "fsdp", "llama3-8b", "h100-nvlink+ib-ndr", (8, 128), 5605 / 5762, 0.03, 2, "bf16-mixed", mfu=0.34,
              assumptions="local batch 2 x 8192, bf16 with fp32 reduction; MFU 0.34 reproduces the 8-GPU 5,762 "
                          "tokens/s (torchtitan reports 33-39%); 400 Gb/s RDMA per GPU as on their Grand Teton hosts"),
    Published("PyTorch DDP paper, ResNet50, V100: 8 -> 256 GPUs",
              "Li et al., PyTorch Distributed, VLDB 2020: near-linear weak scaling to 256 GPUs",
              "ddp", "resnet50", "v100-nvlink+100gbe", (8, 256), 0.95, 0.05, 32, "fp32", "near-linear",
              compute_s=0.1,
              assumptions="32 images per GPU at "
                          "~320 images/s (fp32 V100, 0.1 s per step); 100 Gb/s per 8-GPU node; 25 MiB buckets"),
    Published("PyTorch DDP paper, BERT-large, V100: 8 -> 256 GPUs",
              "Li et al., PyTorch Distributed, VLDB 2020: near-linear weak scaling to 256 GPUs",
              "ddp", "bert-large", "v100-nvlink+100gbe", (8, 256), 0.95, 0.05, 32, "fp32", "near-linear",
              compute_s=0.75,
              assumptions="as ResNet50; 32 sequences of 128 tokens per GPU, 0.75 s per step (~40% of the V100's "
                          "15.7 fp32 TFLOP/s); 340 M parameters, 1.36 GB of fp32 gradients"),
)
