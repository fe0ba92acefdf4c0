"""GrainLoader: order, per-epoch shuffles, exact mid-epoch resume, sharding, validation, Trainer."""

import json
import re

import grain  # in the dev extras: a missing grain fails this file instead of skipping it
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ComposerClassifier, Trainer
from composerjax.data import GrainLoader


class PairSource:
    """64 records ``(x[i], y[i])``: row i of x is ``[i, i, i, i]`` and y[i] = i, so a batch shows its indices."""

    def __init__(self, num_records: int = 64) -> None:
        self.y = np.arange(num_records, dtype=np.int32)
        self.x = np.repeat(self.y[:, None], 4, axis=1).astype(np.float32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[index], self.y[index]


class Negate(grain.transforms.Map):
    def map(self, record):
        x, y = record
        return -x, y


def labels(batches) -> list[list[int]]:
    return [batch[1].tolist() for batch in batches]


def test_unshuffled_batches_are_the_records_in_order():
    source = PairSource()
    loader = GrainLoader(source, batch_size=16, shuffle=False)
    assert len(loader) == 4
    batches = list(loader)
    assert len(batches) == 4
    for index, (x, y) in enumerate(batches):
        np.testing.assert_array_equal(x, source.x[16 * index : 16 * (index + 1)])
        np.testing.assert_array_equal(y, np.arange(16 * index, 16 * (index + 1)))
    assert loader.state_dict() == {"epoch": 1, "batch_in_epoch": 0, "seed": 0, "iterator": None}


def test_remainder_is_dropped_or_kept():
    assert labels(GrainLoader(PairSource(10), batch_size=4, shuffle=False)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    kept = GrainLoader(PairSource(10), batch_size=4, shuffle=False, drop_remainder=False)
    assert len(kept) == 3
    assert labels(kept) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_operations_run_before_batching():
    x, y = next(iter(GrainLoader(PairSource(), batch_size=8, shuffle=False, operations=[Negate()])))
    np.testing.assert_array_equal(x, -PairSource().x[:8])
    np.testing.assert_array_equal(y, np.arange(8))


def test_map_dataset_source():
    dataset = grain.MapDataset.source(PairSource()).map(lambda record: (record[0] * 2, record[1]))
    x, y = next(iter(GrainLoader(dataset, batch_size=8, shuffle=False)))
    np.testing.assert_array_equal(x, 2 * PairSource().x[:8])


def test_shuffled_epochs_differ_and_repeat_for_a_seed():
    loader = GrainLoader(PairSource(), batch_size=16, seed=3)
    epoch0, epoch1 = labels(loader), labels(loader)
    assert epoch0 != epoch1
    for epoch in (epoch0, epoch1):
        assert sorted(sum(epoch, [])) == list(range(64))
        assert epoch != labels(GrainLoader(PairSource(), batch_size=16, shuffle=False))

    again = GrainLoader(PairSource(), batch_size=16, seed=3)
    assert [labels(again), labels(again)] == [epoch0, epoch1]
    assert labels(GrainLoader(PairSource(), batch_size=16, seed=4)) != epoch0


@pytest.mark.parametrize("stop_after", [1, 3])
def test_resume_mid_epoch_matches_the_uninterrupted_run(stop_after):
    reference = GrainLoader(PairSource(), batch_size=8, seed=7)
    uninterrupted = list(reference) + list(reference)  # epochs 0 and 1, 8 batches each

    interrupted = GrainLoader(PairSource(), batch_size=8, seed=7)
    iterator = iter(interrupted)
    taken = [next(iterator) for _ in range(stop_after)]
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state["epoch"] == 0 and state["batch_in_epoch"] == stop_after
    assert isinstance(state["iterator"], dict)

    resumed = GrainLoader(PairSource(), batch_size=8, seed=7)  # a new source object, as in a new process
    resumed.load_state_dict(state)
    rest = list(resumed) + list(resumed)
    assert len(taken) + len(rest) == len(uninterrupted)
    for got, want in zip(taken + rest, uninterrupted, strict=True):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_stopping_after_len_batches_starts_the_next_epoch():
    loader = GrainLoader(PairSource(), batch_size=16, seed=1)
    reference = GrainLoader(PairSource(), batch_size=16, seed=1)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(len(loader))]  # the trainer stops here, not at StopIteration
    assert labels(first) == labels(reference)
    assert loader.state_dict()["batch_in_epoch"] == len(loader)
    assert labels(loader) == labels(reference)


def test_a_new_iterator_mid_epoch_continues_where_the_last_stopped():
    loader = GrainLoader(PairSource(), batch_size=16, seed=4)
    reference = GrainLoader(PairSource(), batch_size=16, seed=4)
    first = iter(loader)
    taken = [next(first), next(first)]
    assert labels(taken) + labels(loader) + labels(loader) == labels(reference) + labels(reference)


def test_set_epoch_restarts_an_epoch():
    loader = GrainLoader(PairSource(), batch_size=16, seed=2)
    epoch0 = labels(loader)
    next(iter(loader))
    loader.set_epoch(0)
    assert labels(loader) == epoch0


def test_processes_split_each_global_batch(monkeypatch):
    single = labels(GrainLoader(PairSource(), batch_size=16, seed=5))
    shares = []
    for process_index in range(2):
        monkeypatch.setattr(jax, "process_index", lambda index=process_index: index)
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        loader = GrainLoader(PairSource(), batch_size=8, seed=5)
        assert len(loader) == 4
        shares.append(labels(loader))
    for batch, first, second in zip(single, *shares, strict=True):
        assert not set(first) & set(second)
        assert sorted(first + second) == sorted(batch)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 4, "seed": -1}, "seed"),
        ({"batch_size": 4, "worker_count": -1}, "worker_count"),
        ({"batch_size": 4, "operations": [grain.transforms.Batch(2)]}, "operations[0]"),
        ({"batch_size": 4, "operations": Negate()}, "operations"),
        ({"batch_size": 128}, "no batch would be produced"),
        ({"batch_size": 4, "read_options": {"num_threads": 2}}, "`read_options` must be a grain.ReadOptions"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        GrainLoader(PairSource(), **kwargs)


def test_default_read_options_are_sixteen_threads_and_a_small_buffer():
    options = GrainLoader(PairSource(), batch_size=8).read_options
    assert (options.num_threads, options.prefetch_buffer_size) == (16, 32)
    given = grain.ReadOptions(num_threads=1, prefetch_buffer_size=3)
    assert GrainLoader(PairSource(), batch_size=4, read_options=given).read_options is given


def test_read_options_change_speed_not_batches_nor_resume():
    """grain's defaults, the loader's and a single thread give the same batches and the same resumed epoch."""
    options = [grain.ReadOptions(), None, grain.ReadOptions(num_threads=1, prefetch_buffer_size=1)]
    runs = []
    for read_options in options:
        loader = GrainLoader(PairSource(), batch_size=8, seed=3, operations=[Negate()], read_options=read_options)
        iterator = iter(loader)
        first = [next(iterator)[1].tolist() for _ in range(3)]
        state = loader.state_dict()
        resumed = GrainLoader(PairSource(), batch_size=8, seed=3, operations=[Negate()], read_options=read_options)
        resumed.load_state_dict(state)
        runs.append((first, labels(resumed), labels(loader)))
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][1] == runs[0][2]  # the resumed loader yields what the original one yields next


def test_bad_source_and_state_are_refused():
    with pytest.raises(ValueError, match="`data_source`"):
        GrainLoader(iter(range(10)), batch_size=2)
    loader = GrainLoader(PairSource(), batch_size=8, seed=1)
    with pytest.raises(ValueError, match="missing \\['iterator'\\]"):
        loader.load_state_dict({"epoch": 0, "batch_in_epoch": 2, "seed": 1})
    with pytest.raises(ValueError, match="`iterator`"):
        loader.load_state_dict({"epoch": 0, "batch_in_epoch": 2, "seed": 1, "iterator": None})
    with pytest.raises(ValueError, match="`batch_in_epoch`"):
        loader.load_state_dict({"epoch": 0, "batch_in_epoch": 9, "seed": 1, "iterator": None})

    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="sampler"):
        GrainLoader(PairSource(32), batch_size=8, seed=1).load_state_dict(state)


def test_trainer_trains_two_epochs_from_grain():
    loader = GrainLoader(PairSource(), batch_size=16, seed=0)
    model = ComposerClassifier(nnx.Linear(4, 64, rngs=nnx.Rngs(0)), num_classes=64)  # labels are 0..63
    trainer = Trainer(
        model,
        loader,
        max_duration="2ep",
        optimizers=optax.sgd(0.1),
        progress_bar=False,
        run_summary=False,
    )
    trainer.fit()
    assert trainer.state.timestamp.batch == 2 * len(loader) == 8
    assert trainer.state.timestamp.epoch == 2
    # The trainer stops each epoch after len(loader) batches, so the loader sits at the end of epoch 1.
    assert {key: loader.state_dict()[key] for key in ("epoch", "batch_in_epoch")} == {"epoch": 1, "batch_in_epoch": 4}



def make_grain_trainer() -> Trainer:
    model = ComposerClassifier(nnx.Linear(4, 64, rngs=nnx.Rngs(0)), num_classes=64)  # labels are 0..63
    loader = GrainLoader(PairSource(), batch_size=16, seed=0)
    return Trainer(model, loader, max_duration="3ep", optimizers=optax.sgd(0.01), progress_bar=False,
                   run_summary=False)


def test_trainer_resumes_mid_epoch_bit_identically():
    uninterrupted = make_grain_trainer()
    uninterrupted.fit()

    first = make_grain_trainer()
    first.fit("6ba")  # mid-epoch 1 (4 batches per epoch)
    saved = jax.device_get(first.state.state_dict())
    # Checkpoints keep the data-loader position as JSON.
    saved["dataloader"] = json.loads(json.dumps(saved["dataloader"]))

    resumed = make_grain_trainer()
    resumed.state.load_state_dict(saved)
    assert resumed.state.timestamp.batch == 6 and resumed.state.timestamp.batch_in_epoch == 2
    resumed.fit()
    assert resumed.state.timestamp.batch == uninterrupted.state.timestamp.batch == 12
    want = jax.tree.leaves(jax.device_get(uninterrupted.state.train_state))
    got = jax.tree.leaves(jax.device_get(resumed.state.train_state))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
