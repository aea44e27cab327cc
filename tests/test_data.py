from pathlib import Path

import numpy as np
import pytest
import torch

from disttrain.config import DataConfig
from disttrain.data import (
    IGNORE_INDEX,
    GlobalSampler,
    TokenWindows,
    build_datasets,
    collate,
    eval_shard,
    load_tokens,
    split_micro,
    synthetic_corpus,
)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_global_stream_does_not_depend_on_world_size(world):
    sampler = GlobalSampler(num_samples=37, seed=5)
    global_batch = 12
    for cursor in (0, 12, 36, 96):  # includes batches that straddle an epoch boundary
        stitched = [i for rank in range(world) for i in sampler.rank_indices(cursor, global_batch, world, rank)]
        assert stitched == sampler.global_indices(cursor, global_batch)


def test_stream_is_a_pure_function_and_each_epoch_is_a_permutation():
    a, b = GlobalSampler(50, seed=1), GlobalSampler(50, seed=1)
    assert a.global_indices(40, 30) == b.global_indices(40, 30)  # fresh objects, same answer
    assert sorted(a.global_indices(50, 50)) == list(range(50))  # epoch 1 covers every sample once
    assert a.global_indices(0, 50) != a.global_indices(50, 50)  # and is reshuffled
    assert GlobalSampler(50, seed=2).global_indices(0, 50) != a.global_indices(0, 50)
    assert GlobalSampler(5, seed=1, shuffle=False).global_indices(3, 4) == [3, 4, 0, 1]


@pytest.mark.parametrize("n, world", [(7, 2), (13, 4), (2, 3), (100, 1)])
def test_eval_shards_cover_every_sample_exactly_once(n, world):
    shards = [list(eval_shard(n, world, rank)) for rank in range(world)]
    assert sorted(i for shard in shards for i in shard) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_collate_pads_variable_length_sequences():
    items = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([2, 3, 4])},
             {"input_ids": torch.tensor([5]), "labels": torch.tensor([6])}]
    batch = collate(items)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [5, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, 4], [6, IGNORE_INDEX, IGNORE_INDEX]]
    x, y = collate([(torch.ones(2), torch.zeros(1)), (torch.ones(2), torch.zeros(1))])
    assert x.shape == (2, 2) and y.shape == (2, 1)
    assert split_micro(list(range(5)), 2) == [[0, 1], [2, 3], [4]]


def test_windows_shift_labels_by_one():
    ds = TokenWindows(np.arange(20, dtype=np.uint16), seq_len=4)
    assert len(ds) == 4
    assert ds[1]["input_ids"].tolist() == [4, 5, 6, 7] and ds[1]["labels"].tolist() == [5, 6, 7, 8]


def test_text_bin_and_npy_sources_load_the_same_tokens(tmp_path: Path):
    tokens = np.frombuffer(b"hello distributed world", dtype=np.uint8)
    (tmp_path / "t.txt").write_bytes(tokens.tobytes())
    tokens.astype(np.uint16).tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    for name in ("t.txt", "t.bin", "t.npy"):
        loaded = load_tokens(DataConfig(source=str(tmp_path / name)))
        assert np.array_equal(np.asarray(loaded, dtype=np.int64), tokens.astype(np.int64)), name


def test_builtin_corpus_is_deterministic_text_and_splits():
    corpus = synthetic_corpus()
    assert len(corpus) == 1 << 20 and np.array_equal(corpus, synthetic_corpus.__wrapped__())
    assert corpus.max() < 128  # plain ASCII text
    train, val = build_datasets(DataConfig(), seq_len=64)
    assert len(train) > 8 * len(val) > 0


def test_collate_pads_every_key_of_python_list_items():
    """Rows of a Hugging Face datasets.Dataset are dicts of python lists; every key is padded on the right."""
    items = [{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "labels": [1, 2, 3], "score": [0.5, 1.5, 2.5],
              "id": 7},
             {"input_ids": [4], "attention_mask": [1], "labels": [4], "score": [3.0], "id": 8}]
    batch = collate(items)
    assert list(batch) == ["input_ids", "attention_mask", "labels", "score", "id"]
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]] and batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["score"].tolist() == [[0.5, 1.5, 2.5], [3.0, 0.0, 0.0]] and batch["score"].dtype == torch.float32
    assert batch["id"].tolist() == [7, 8]
    shorter_labels = collate([{"input_ids": [1, 2, 3], "labels": [2, 3]}, {"input_ids": [4], "labels": [5]}])
    assert shorter_labels["labels"].tolist() == [[2, 3, IGNORE_INDEX], [5, IGNORE_INDEX, IGNORE_INDEX]]


@pytest.mark.parametrize("items, message", [
    ([{"input_ids": [1, 2], "labels": [1, 2, 3]}], "3 labels for 2 input_ids"),
    ([{"input_ids": [1], "labels": [1]}, {"input_ids": [1]}], "item 1 of a batch has keys"),
])
def test_collate_refuses_bad_items_in_one_line(items, message):
    from disttrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as info:
        collate(items)
    assert "\n" not in str(info.value)
