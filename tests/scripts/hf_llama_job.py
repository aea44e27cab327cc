"""A tiny transformers Llama trained by the Trainer (no downloads), for `ckpt export --format hf` tests.

    python hf_llama_job.py OUT_DIR [--set k=v ...]                                        (one process)
    disttrain launch --nproc 2 hf_llama_job.py OUT_DIR --set parallel.strategy=fsdp     (two ranks)

Trains two models, `tie_word_embeddings` true and false, 2 steps each, with a checkpoint at step 2, as the
runs OUT_DIR/tied and OUT_DIR/untied. Rank 0 writes OUT_DIR/<run>/logits.safetensors: the trained model's
logits on `PROBE` (every rank runs that forward: under fsdp it communicates).
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from disttrain import Trainer, load_config
from disttrain.runtime import exit_process, init_runtime, shutdown

PROBE = torch.arange(24).reshape(2, 12) * 7 % 256


def tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=tied))


def next_token_loss(outputs, batch):
    """Summed next-token cross-entropy over a batch of tuples `(input_ids,)`."""
    logits, ids = outputs.logits[:, :-1], batch[0][:, 1:]
    return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction="sum"), ids.numel()


def main() -> None:
    from safetensors.torch import save_file

    out = Path(sys.argv[1])
    overrides = [arg for arg in sys.argv[2:] if arg != "--set"]
    data = TensorDataset(torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(0)))
    runtime = None
    for name, tied in (("tied", True), ("untied", False)):
        cfg = load_config(None, [f"run.out_dir={out}", f"run.name={name}", "train.steps=2", "checkpoint.every=2",
                                 "data.global_batch_size=4", "data.micro_batch_size=2", "optim.lr=0.01",
                                 "log.progress=false", "dist.threads_per_rank=1", *overrides])
        runtime = runtime or init_runtime(cfg.dist, always_form_group="parallel.strategy=fsdp" in overrides)
        trainer = Trainer(cfg, model=tiny_llama(tied), train_dataset=data, loss_fn=next_token_loss, runtime=runtime)
        trainer.fit()
        logits = trainer.backend.forward((PROBE,)).logits
        if runtime.is_main_process():
            save_file({"logits": logits.contiguous()}, str(out / name / "logits.safetensors"))
        del trainer  # see runtime.shutdown: nothing holding the process group may outlive it
    shutdown(runtime)


if __name__ == "__main__":
    main()
    exit_process(0)
