"""Fine-tune a Hugging Face causal LM with disttrain, end to end, offline:

    python examples/finetune_hf.py [--nproc 2] [--steps 60] [--precision fp32] [--out runs]

1. writes a small text corpus (disttrain's built-in synthetic language) as JSONL documents,
2. trains a byte-level BPE tokenizer on it with `tokenizers` and saves it as a transformers tokenizer,
3. creates a small Llama-family model from a config and saves it with `save_pretrained` (the "pretrained" model
   you would otherwise have downloaded),
4. fine-tunes it with `disttrain train examples/finetune_hf.toml --nproc 2` under fsdp (sharded start: no rank
   holds the full model), the JSONL tokenised once and cached next to it,
5. exports the last checkpoint with `disttrain ckpt export ... --format hf` and generates text from the export with
   transformers.

Steps 1-3 stand in for what you already have (your model directory, tokenizer and data); step 4 is the command
you would run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_corpus(path: Path, documents: int = 3000) -> None:
    """JSONL documents of the built-in synthetic language (a learnable made-up language of 50 words)."""
    from disttrain.data import synthetic_corpus

    text = synthetic_corpus().tobytes().decode()
    sentences = [s.strip() + "." for s in text.split(".") if s.strip()]
    with path.open("w") as f:
        for i in range(min(documents, len(sentences) // 3)):
            f.write(json.dumps({"text": " ".join(sentences[3 * i:3 * i + 3])}) + "\n")


def train_tokenizer(corpus: Path, directory: Path, vocab_size: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>").save_pretrained(directory)


def create_base_model(directory: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(directory)


def disttrain(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "disttrain", *args], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--precision", default="fp32", help="e.g. bf16-mixed on a GPU")
    p.add_argument("--out", default="runs", help="folder for the assets, the run and the export")
    args = p.parse_args()
    out = Path(args.out).resolve()
    assets = out / "finetune_hf_assets"
    assets.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer_dir, base = assets / "docs.jsonl", assets / "tokenizer", assets / "base"
    if not corpus.exists():
        write_corpus(corpus)
    if not tokenizer_dir.exists():
        train_tokenizer(corpus, tokenizer_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not base.exists():
        create_base_model(base, vocab_size=len(tokenizer))

    # 4. the fine-tuning run: this is the command you would type
    disttrain("train", str(HERE / "finetune_hf.toml"), "--nproc", str(args.nproc),
              "--set", f"model.name=hf:{base}", "--set", f"data.source={corpus}",
              "--set", f"data.tokenizer={tokenizer_dir}", "--set", f"run.out_dir={out}",
              "--set", f"train.steps={args.steps}", "--set", f"checkpoint.every={args.steps}",
              "--set", f"parallel.precision={args.precision}", "--set", "checkpoint.resume=never")
    metrics = [json.loads(line) for line in (out / "finetune_hf" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} logged steps")

    # 5. back to Hugging Face: a folder from_pretrained loads, with the tokenizer next to it
    exported = out / "finetune_hf_export"
    disttrain("ckpt", "export", str(out / "finetune_hf" / "checkpoints" / f"step_{args.steps}"), str(exported),
              "--format", "hf", "--force")
    tokenizer.save_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported)
    prompt = tokenizer(json.loads(corpus.read_text().splitlines()[0])["text"][:30], return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    print("generated:", tokenizer.decode(generated[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
