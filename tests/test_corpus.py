"""Documents tokenised with a local Hugging Face tokenizer (trained here: nothing downloads), packed with EOS
between documents, cached next to the source; the user errors, through the CLI."""

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from conftest import read_metrics, run_cli
from disttrain import corpus
from disttrain.cli import main
from disttrain.config import DataConfig
from disttrain.data import load_tokens

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bakers".split()


def _text(seed: int, n_docs: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) for _ in range(n_docs)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_text(0, 200), trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"]))
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(out)
    return out


@pytest.fixture
def jsonl(tmp_path) -> tuple[Path, list[str]]:
    docs = _text(1, 60)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    return path, docs


def _expected(tokenizer_dir: Path, docs: list[str]) -> list[int]:
    tok = corpus.load_tokenizer(str(tokenizer_dir))
    return [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]


def test_jsonl_is_tokenised_once_packed_with_eos_and_cached(tokenizer_dir, jsonl, monkeypatch):
    path, docs = jsonl
    cfg = DataConfig(source=str(path), tokenizer=str(tokenizer_dir), text_field="body")
    tokens = load_tokens(cfg)
    assert np.asarray(tokens).tolist() == _expected(tokenizer_dir, docs)
    eos = corpus.load_tokenizer(str(tokenizer_dir)).eos_token_id
    assert int((np.asarray(tokens) == eos).sum()) == len(docs)
    caches = list(path.parent.glob("docs.jsonl.*.tokens.npy"))
    assert len(caches) == 1 and not list(path.parent.glob("*.tmp*"))

    def no_second_tokenisation(*args):
        raise AssertionError("tokenised again although the cache is current")

    monkeypatch.setattr(corpus, "tokenize", no_second_tokenisation)
    assert np.array_equal(load_tokens(cfg), tokens)  # read from the cache
    monkeypatch.undo()
    with path.open("a") as f:  # a changed source gets a new cache, never the stale one
        f.write(json.dumps({"body": "quick fox"}) + "\n")
    assert len(load_tokens(cfg)) > len(tokens)
    assert len(list(path.parent.glob("docs.jsonl.*.tokens.npy"))) == 2


def test_text_file_documents_are_separated_by_blank_lines(tokenizer_dir, tmp_path):
    docs = _text(2, 5)
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(docs[:2]) + "\n  \n\n" + "\n\n".join(docs[2:]) + "\n")
    tokens = load_tokens(DataConfig(source=str(path), tokenizer=str(tokenizer_dir)))
    assert np.asarray(tokens).tolist() == _expected(tokenizer_dir, docs)
    assert np.asarray(load_tokens(DataConfig(source=str(path)))).tolist() == list(path.read_bytes())  # bytes


def _stream(args):
    return np.asarray(corpus.token_stream(*args)).tolist()


def test_ranks_starting_together_share_one_cache(tokenizer_dir, jsonl):
    path, docs = jsonl
    with multiprocessing.get_context("fork").Pool(3) as pool:
        results = pool.map(_stream, [(str(path), str(tokenizer_dir), "body")] * 3)
    assert results[0] == results[1] == results[2] == _expected(tokenizer_dir, docs)
    assert len(list(path.parent.glob("docs.jsonl.*.tokens.npy"))) == 1 and not list(path.parent.glob("*.tmp*"))


def test_training_on_jsonl_with_a_tokenizer(tokenizer_dir, jsonl, tmp_path, small_gpt):
    path, _ = jsonl
    result = run_cli(["train", *small_gpt, "--set", f"data.source={path}", "--set", f"data.tokenizer={tokenizer_dir}",
                      "--set", "data.text_field=body", "--set", "model.vocab_size=128", "--set", "model.seq_len=16",
                      "--set", "train.steps=4", "--set", "train.eval_every=2", "--set", "data.num_workers=2",
                      "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=4"], tmp_path)
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "runs" / "default")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and metrics[-1]["eval_loss"] > 0


BAD = [
    (["--set", "data.tokenizer=missing_dir/tok/x"], "data.tokenizer = 'missing_dir/tok/x' is not a local directory"),
    (["--set", "data.tokenizer=gpt2"], "looks like a Hugging Face hub id, and disttrain never downloads"),
    (["--set", "data.tokenizer=openai-community/gpt2"], "looks like a Hugging Face hub id"),
    (["--set", "data.source={jsonl}"], "is a .jsonl file but data.tokenizer is not set"),
    (["--set", "data.source={jsonl}", "--set", "data.tokenizer={tok}"], "no string under data.text_field = 'text'"),
    (["--set", "data.source={jsonl}", "--set", "data.tokenizer={tok}", "--set", "data.text_field=body",
      "--set", "model.vocab_size=64"], "model.vocab_size = 64 is smaller than the vocabulary"),
    (["--set", "data.source={jsonl}", "--set", "data.tokenizer={jsonl}"], "is not a local directory"),
    (["--set", "data.tokenizer={tok}"], "data.source = 'builtin' is not a text or .jsonl file"),
    (["--set", "data.num_workers=-1"], "data.num_workers = -1: must be >= 0"),
]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_data_settings_are_one_line_and_exit_2(args, message, tokenizer_dir, jsonl, tmp_path, monkeypatch,
                                                    capsys):
    monkeypatch.chdir(tmp_path)
    args = [a.format(jsonl=jsonl[0], tok=tokenizer_dir) for a in args]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disttrain: error: ") and message in err[0], err
    assert not (tmp_path / "runs").exists()  # refused before anything was written or started
    assert not list(tmp_path.glob("*.tokens.npy"))
