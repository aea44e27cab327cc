"""Batches through a torch DataLoader whose batch sampler is disttrain's global sample stream.

The training loader iterates `StepBatches`: this rank's micro-batch index lists, step after step, from the resume
cursor on (`GlobalSampler.rank_indices` split by `split_micro`). The DataLoader only decides where a batch is
built (in the training process, or ahead of the step in `data.num_workers` worker processes) and never which
samples it holds, so the run is the same for any number of workers and a resumed run continues the same stream.

Worker processes end when the loader is closed: `Loaders` is a context manager, closed when training ends or
raises (torch's workers also exit on their own when their parent dies). A user error raised by the collate
function in a worker (e.g. labels longer than inputs) travels back as a value and is raised in the training
process as the one-line `ConfigError` it was, rather than as torch's multi-line wrapped copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from disttrain.config import DataConfig
from disttrain.data import GlobalSampler, split_micro
from disttrain.errors import ConfigError

CollateFn = Callable[[list[Any]], Any]


def check_dataset(dataset: Any, name: str) -> None:
    """Refuse, in one line, a dataset that has no index: its stream cannot be resumed exactly."""
    kind = type(dataset).__name__
    iterable = isinstance(dataset, (IterableDataset, DataLoader)) or (
        type(dataset).__module__.startswith("datasets.") and "Iterable" in kind)
    if iterable or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(f"{name} is a {kind}: disttrain needs a map-style dataset (len() and [index]), because "
                          "the sample stream is a list of indices and that is what makes resume exact; materialise "
                          "it (a list, a torch map-style Dataset, or datasets.Dataset.from_generator / "
                          "load_dataset(..., streaming=False))")


class StepBatches(Sampler[list[int]]):
    """This rank's micro-batch index lists for `steps` optimizer steps, from stream position `cursor` on."""

    def __init__(self, sampler: GlobalSampler, cursor: int, steps: int, global_batch: int, micro_batch: int,
                 world_size: int, rank: int):
        self.sampler, self.cursor, self.steps = sampler, cursor, steps
        self.global_batch, self.micro_batch, self.world_size, self.rank = global_batch, micro_batch, world_size, rank

    def step(self, k: int) -> list[list[int]]:
        """Micro-batches of the k-th step from the cursor."""
        indices = self.sampler.rank_indices(self.cursor + k * self.global_batch, self.global_batch,
                                            self.world_size, self.rank)
        return split_micro(indices, self.micro_batch)

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(self.steps):
            yield from self.step(k)

    def __len__(self) -> int:
        per_rank = self.global_batch // self.world_size
        return self.steps * -(-per_rank // self.micro_batch)


class _Failed:
    """A user error from a worker, carried back as a value (see the module docstring)."""

    def __init__(self, message: str):
        self.message = message


class _CollateInWorker:
    """The user's collate function, with its ConfigError returned rather than raised (picklable)."""

    def __init__(self, collate_fn: CollateFn):
        self.collate_fn = collate_fn

    def __call__(self, items: list[Any]) -> Any:
        try:
            return self.collate_fn(items)
        except ConfigError as exc:
            return _Failed(str(exc))


class Loaders:
    """The DataLoaders of one run on one rank: `train(...)` once, `eval(...)` at each evaluation; `close()`
    (or leaving the `with` block) ends every worker process."""

    def __init__(self, cfg: DataConfig, collate_fn: CollateFn, device: torch.device, seed: int):
        self.cfg, self.collate_fn, self.device, self.seed = cfg, collate_fn, device, seed
        self._loaders: dict[str, DataLoader] = {}
        self._open: list[_Batches] = []

    def _loader(self, dataset: Dataset, batch_sampler: Iterable[Sequence[int]], seed: int) -> DataLoader:
        workers = self.cfg.num_workers
        extra = {"prefetch_factor": self.cfg.prefetch_factor, "persistent_workers": self.cfg.persistent_workers} \
            if workers else {}
        # The loader draws its workers' base seed from this generator, not from torch's global RNG, which
        # would shift dropout masks and break exact resume.
        return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=workers,
                          collate_fn=_CollateInWorker(self.collate_fn), pin_memory=self.device.type == "cuda",
                          generator=torch.Generator().manual_seed(seed), **extra)

    def train(self, dataset: Dataset, batches: StepBatches) -> Iterator[Any]:
        """The training batches, in stream order. Workers are seeded from (run seed, rank, cursor)."""
        loader = self._loader(dataset, batches, seed=hash((self.seed, batches.rank, batches.cursor)) & (2**62 - 1))
        self._loaders["train"] = loader
        return self._unwrap(loader)

    def eval(self, dataset: Dataset, batches: list[list[int]]) -> Iterator[Any]:
        """The evaluation batches; with `data.persistent_workers` the same workers serve every evaluation."""
        loader = self._loaders.get("eval")
        if loader is None or loader.dataset is not dataset or loader.batch_sampler != batches:
            loader = self._loaders["eval"] = self._loader(dataset, batches, seed=self.seed)
        return self._unwrap(loader)

    def _unwrap(self, loader: DataLoader) -> Iterator[Any]:
        batches = _Batches(iter(loader))
        self._open = [b for b in self._open if b.active] + [batches]
        return batches

    def close(self) -> None:
        """Drop every loader and iterator: torch ends an iterator's workers when it is freed (even while a
        traceback still holds frames of the training loop, which reference only the `_Batches` wrappers)."""
        for batches in self._open:
            batches.close()
        self._open.clear()
        self._loaders.clear()

    def __enter__(self) -> Loaders:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Batches:
    """A DataLoader iterator that raises a worker's ConfigError as itself and can be dropped on demand."""

    def __init__(self, iterator: Iterator[Any]):
        self._iterator: Iterator[Any] | None = iterator

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            raise StopIteration
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.close()
            raise
        except Exception as exc:
            self.close()
            # torch's frames in the traceback hold its iterator (and so its workers) alive; its message
            # already carries the worker's traceback.
            raise exc.with_traceback(None) from None
        if isinstance(batch, _Failed):
            self.close()
            raise ConfigError(batch.message)
        return batch

    @property
    def active(self) -> bool:
        return self._iterator is not None

    def close(self) -> None:
        self._iterator = None


def probe(dataset: Dataset, indices: Sequence[int], collate_fn: CollateFn) -> None:
    """Build one batch in this process, so that bad items are refused before any worker starts."""
    collate_fn([dataset[i] for i in indices])
