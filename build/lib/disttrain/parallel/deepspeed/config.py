"""The DeepSpeed JSON that the `deepspeed` strategy runs with, generated from the disttrain config.

disttrain owns the keys that decide the numbers (batch, gradient clipping, ZeRO stage, offload, precision,
optimizer and schedule); it also caps DeepSpeed's gradient bucket by the model's size (below); everything else in
a user's JSON (`parallel.deepspeed_config`: bucket sizes, `overlap_comm`, stage-3 tuning, ...) is passed through
unchanged. A user JSON that sets an owned key to the value disttrain's settings give is accepted (the JSON of
../shared/seeds/004: ZeRO-3 with `offload_optimizer` and `offload_param` to a pinned cpu, `"bf16": {"enabled":
true}`, agrees with `parallel.deepspeed_stage = 3`, `parallel.cpu_offload = true`, `parallel.precision =
"bf16-mixed"`); one that sets it to a different value is an error naming both, rather than one silently winning.
Pure: no torch, no deepspeed.

    DeepSpeedConfig.from_config(cfg, world).save_config("ds.json")     # what `disttrain deepspeed-config` does
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.errors import ConfigError

if TYPE_CHECKING:
    from disttrain.config import Config, ParallelConfig

# DeepSpeed's default `reduce_bucket_size` (elements). ZeRO-1/2 allocate one such buffer (two with
# overlap_comm) for every backward, and ZeRO-3 keeps one for the whole run: 2 GB of float32 whatever the
# model's size. Unless the user's JSON sets it, disttrain caps it: under ZeRO-1/2 at the model's size (a
# bucket never holds more: the same single reduction as the default), under ZeRO-3 at one rank's share of
# the model (a few reductions per step, so the buffer it holds all run costs no more than its gradient
# partition, and ZeRO-3 keeps holding less than ZeRO-2).
DEFAULT_REDUCE_BUCKET = 500_000_000

# Sections disttrain refuses in a user JSON: the optimizer and schedule are the user's torch ones (the
# client optimizer: no native op to compile, the same numbers as every other strategy).
REFUSED = {"optimizer": "optim.*", "scheduler": "optim.* (warmup_steps, min_lr_ratio)"}
# Precision is disttrain's policy (autocast and its loss scale around the engine, fp32 weights), so an enabled
# precision section is accepted only as a statement of that policy: `{"enabled": true}` where parallel.precision
# is the matching mixed precision. The section is then left out of the engine's JSON (autocast does it). Anything
# else in it (DeepSpeed's own loss scale, bf16 weights in the engine) would change the numbers: refused.
PRECISION_SECTIONS = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "torch_autocast": None}


@dataclass
class DeepSpeedConfig:
    stage: int = 2
    """ZeRO stage 0-3 (`parallel.deepspeed_stage`)."""
    cpu_offload: bool = False
    """ZeRO-Offload of the optimizer state and step to the host (`parallel.cpu_offload`), and under ZeRO-3 of
    the parameters too (`offload_param`), as FSDP's CPUOffloadPolicy does for the fsdp strategies."""
    precision: str = "fp32"
    """`parallel.precision`: which precision section of a user JSON agrees with it."""
    grad_clip: float = 0.0
    """`gradient_clipping` (`optim.grad_clip`): DeepSpeed clips inside its step, on the partitioned gradients."""
    micro_batch_size: int = 1
    accumulation_steps: int = 1
    world_size: int = 1
    user: dict[str, Any] = field(default_factory=dict)
    """The JSON of `parallel.deepspeed_config` (empty when not set)."""
    source: str = ""
    model_numel: int = 0
    """Trainable elements of the model (0: unknown); caps `reduce_bucket_size` unless the JSON sets it."""

    @classmethod
    def from_config(cls, cfg: Config, world: int, model_numel: int = 0) -> DeepSpeedConfig:
        """The JSON for `cfg` at `world` ranks, with the true batch sizes (checked against a user JSON)."""
        d = cfg.data
        per_step = d.micro_batch_size * world
        if per_step <= 0 or d.global_batch_size <= 0 or d.global_batch_size % per_step:
            raise ConfigError(f"data.global_batch_size = {d.global_batch_size} is not a positive multiple of "
                              f"data.micro_batch_size x world size = {d.micro_batch_size} x {world}; change one")
        accumulation = d.global_batch_size // per_step
        out = cls.from_parallel(cfg.parallel, world, cfg.optim.grad_clip, d.micro_batch_size, accumulation,
                                model_numel)
        out.check_batch()
        return out

    @classmethod
    def from_parallel(cls, p: ParallelConfig, world: int, grad_clip: float, micro_batch_size: int = 1,
                      accumulation_steps: int = 1, model_numel: int = 0) -> DeepSpeedConfig:
        """The strategy's view. The backend owns accumulation boundaries and normalisation (see
        parallel/deepspeed/engine.py), so the engine's batch keys only have to be consistent."""
        if p.deepspeed_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.deepspeed_stage = {p.deepspeed_stage}: must be 0, 1, 2 or 3")
        if p.cpu_offload and p.deepspeed_stage == 0:
            raise ConfigError("parallel.cpu_offload = true needs ZeRO stage 1, 2 or 3 under deepspeed; set "
                              "parallel.deepspeed_stage >= 1 or parallel.cpu_offload = false")
        out = cls(stage=p.deepspeed_stage, cpu_offload=p.cpu_offload, precision=p.precision, grad_clip=grad_clip,
                  micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps, world_size=world,
                  user=_read_json(p.deepspeed_config) if p.deepspeed_config else {}, source=p.deepspeed_config,
                  model_numel=model_numel)
        out.to_dict()  # conflicts surface here, before any process starts
        return out

    def owned(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if self.cpu_offload:
            zero["offload_optimizer"] = {"device": "cpu"}
            if self.stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        return {
            "train_batch_size": self.micro_batch_size * self.accumulation_steps * self.world_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.accumulation_steps,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": zero,
            # the user's torch optimizer under ZeRO (DeepSpeed calls that "untested") and under ZeRO-Offload
            # (by default it demands its compiled DeepSpeedCPUAdam)
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
        }

    def to_dict(self) -> dict[str, Any]:
        """The user's JSON with disttrain's keys merged in; ConfigError on a disagreement."""
        where = f"parallel.deepspeed_config ({self.source})"
        for key, setting in REFUSED.items():
            if key in self.user:
                raise ConfigError(f"{where} has a '{key}' section; disttrain sets that through {setting}: "
                                  f"remove '{key}' from the JSON")
        merged = json.loads(json.dumps(self.user))
        for key, agrees in PRECISION_SECTIONS.items():
            section = merged.pop(key, None)
            if section is not None and _precision_section_disagrees(section, agrees, self.precision):
                raise ConfigError(f"{where}: '{key}' = {json.dumps(section)} disagrees with parallel.precision = "
                                  f"{self.precision!r}; disttrain sets precision through parallel.precision"
                                  + (f" (\"{key}\": {{\"enabled\": true}} means {agrees!r})" if agrees else "")
                                  + f": remove '{key}' from the JSON or change the setting")
        zero = merged.setdefault("zero_optimization", {})
        # the backend reads the gradient norm, and DeepSpeed's overflow check (skipping a non-finite step) needs it
        _agree(where, "zero_optimization.compute_grad_norm", zero.get("compute_grad_norm", True), True)
        for key, value in self.owned().items():
            if key == "zero_optimization":
                for zkey, zvalue in value.items():
                    if not zkey.startswith("offload_"):
                        _agree(where, f"zero_optimization.{zkey}", zero.get(zkey, zvalue), zvalue)
                        zero[zkey] = zvalue
                for zkey in ("offload_optimizer", "offload_param"):  # the device is owned; pin_memory etc. pass
                    theirs, ours = zero.get(zkey) or {}, value.get(zkey, {"device": "none"})
                    _agree(where, f"zero_optimization.{zkey}.device", theirs.get("device", ours["device"]),
                           ours["device"])
                    if zkey in value:
                        zero[zkey] = {**theirs, **ours}
            elif key.startswith("train") or key == "gradient_accumulation_steps":
                merged[key] = value  # checked against the real batch by check_batch (the CLI and validate)
            else:
                _agree(where, key, merged.get(key, value), value)
                merged[key] = value
        if self.model_numel:
            cap = -(-self.model_numel // self.world_size) if self.stage == 3 else self.model_numel
            merged["zero_optimization"].setdefault("reduce_bucket_size", min(DEFAULT_REDUCE_BUCKET, cap))
        merged.setdefault("steps_per_print", 2**31 - 1)  # disttrain logs the steps
        return merged

    def check_batch(self) -> None:
        where = f"parallel.deepspeed_config ({self.source})"
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            _agree(where, key, self.user.get(key, self.owned()[key]), self.owned()[key])

    def save_config(self, path: str | os.PathLike) -> None:
        """Write the JSON (indented, keys sorted) atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)


SETTING_OF = {"gradient_clipping": "optim.grad_clip", "zero_optimization.stage": "parallel.deepspeed_stage",
              "zero_optimization.offload_optimizer.device": "parallel.cpu_offload",
              "zero_optimization.offload_param.device": "parallel.cpu_offload (parameters offload under ZeRO-3 only)",
              "train_batch_size": "data.global_batch_size", "train_micro_batch_size_per_gpu": "data.micro_batch_size",
              "gradient_accumulation_steps": "data.global_batch_size / (micro_batch_size x world size)",
              "zero_allow_untested_optimizer": "the strategy (the user's torch optimizer runs under ZeRO)",
              "zero_optimization.compute_grad_norm": "the strategy (the gradient norm and the non-finite check)",
              "zero_force_ds_cpu_optimizer": "the strategy (the user's torch optimizer runs under ZeRO-Offload)"}


def _precision_section_disagrees(section: Any, agrees: str | None, precision: str) -> bool:
    if not isinstance(section, dict) or not section.get("enabled", False):
        return False  # a disabled section says nothing
    return agrees != precision or set(section) != {"enabled"}


def _agree(where: str, key: str, theirs: Any, ours: Any) -> None:
    if theirs != ours:
        raise ConfigError(f"{where}: '{key}' = {json.dumps(theirs)} disagrees with {SETTING_OF[key]} "
                          f"(which gives {json.dumps(ours)}); remove '{key}' from the JSON or change the setting")


def _read_json(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"parallel.deepspeed_config = {path!r}: file not found; give an existing DeepSpeed "
                          "JSON, or \"\" to generate it from the config") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"parallel.deepspeed_config = {path!r} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"parallel.deepspeed_config = {path!r}: expected a JSON object {{...}}")
    zero = data.get("zero_optimization", {})
    sections = [("zero_optimization", zero)] + ([(f"zero_optimization.{k}", zero[k]) for k in (
        "offload_optimizer", "offload_param") if k in zero] if isinstance(zero, dict) else [])
    for key, section in sections:
        if not isinstance(section, dict):
            raise ConfigError(f"parallel.deepspeed_config = {path!r}: '{key}' = {json.dumps(section)} is not a JSON "
                              "object {...}; fix the file (DeepSpeed's sections are objects)")
    return data
