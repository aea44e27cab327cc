"""`deepspeed`: DeepSpeed's engine running ZeRO stage 0-3 (optional extra: `pip install 'disttrain[deepspeed]'`).

engine.py (apply, the engine's backward/step/state dict), config.py (the engine JSON), memory.py (ZeRO's layout),
timed.py (its collectives timed for comm_s).
"""

from __future__ import annotations

from disttrain.errors import ConfigError
from disttrain.parallel.deepspeed.config import DeepSpeedConfig
from disttrain.parallel.deepspeed.engine import apply
from disttrain.parallel.deepspeed.memory import memory
from disttrain.parallel.spec import StrategySpec


def check(cfg, world: int) -> None:
    if cfg.parallel.precision == "bf16-true":
        raise ConfigError(
            "parallel.precision = 'bf16-true' with parallel.strategy = 'deepspeed': DeepSpeed's ZeRO keeps an fp32 "
            "master copy of every partition, so the weights would not be bf16 only. Use bf16-mixed (autocast, fp32 "
            "weights) or fp16-mixed with deepspeed, or an FSDP strategy (zero2, fsdp) for bf16-true")
    DeepSpeedConfig.from_config(cfg, world)  # stage, offload and the JSON's keys, each checked with its setting


SPECS = (StrategySpec("deepspeed", apply, "DeepSpeed's engine, ZeRO stage parallel.deepspeed_stage (0-3), "
                      "optional ZeRO-Offload", memory, check, package="deepspeed",
                      options=frozenset({"cpu_offload", "deepspeed_stage", "deepspeed_config"}),
                      sharded_start=lambda parallel: parallel.deepspeed_stage == 3,
                      # ZeRO-3 replaces torch.nn.functional.linear for the rest of the process (DeepSpeed's
                      # memory-efficient linear, which saves other tensors under autocast): its runs come last
                      variants=tuple((f"deepspeed-z{stage}{'-off' if off else ''}",
                                      (f"parallel.deepspeed_stage={stage}", f"parallel.cpu_offload={str(off).lower()}"))
                                     for stage, off in ((0, False), (1, False), (2, False), (1, True), (2, True),
                                                        (3, False), (3, True)))),)
