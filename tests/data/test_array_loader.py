"""ArrayLoader: coverage, determinism, exact mid-epoch resume, per-process sharding, validation."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from composerjax.data import ArrayLoader, as_batch_iterable


def make_arrays(num_samples: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Features whose row i is [i, i] and labels equal to i, so a batch reveals its indices."""
    labels = np.arange(num_samples)
    return np.stack([labels, labels], axis=1).astype(np.float32), labels


def batch_indices(loader: ArrayLoader) -> list[np.ndarray]:
    return [labels for _, labels in loader]


def test_every_sample_once_per_epoch_without_drop_last():
    loader = ArrayLoader(make_arrays(10), batch_size=3, drop_last=False, seed=1)
    assert len(loader) == 4
    for _ in range(2):
        batches = batch_indices(loader)
        assert [len(b) for b in batches] == [3, 3, 3, 1]
        np.testing.assert_array_equal(np.sort(np.concatenate(batches)), np.arange(10))


def test_drop_last_counts():
    loader = ArrayLoader(make_arrays(10), batch_size=3)
    assert len(loader) == 3
    batches = batch_indices(loader)
    assert [len(b) for b in batches] == [3, 3, 3]
    assert len(np.unique(np.concatenate(batches))) == 9
    assert len(ArrayLoader(make_arrays(9), batch_size=3)) == 3
    assert len(ArrayLoader(make_arrays(9), batch_size=3, drop_last=False)) == 3


def test_features_follow_labels():
    for features, labels in ArrayLoader(make_arrays(10), batch_size=4, seed=3):
        assert features.shape == (4, 2) and features.dtype == np.float32
        np.testing.assert_array_equal(features[:, 0], labels)


def test_same_seed_same_order_and_epochs_differ():
    first, second = (ArrayLoader(make_arrays(20), batch_size=5, seed=7) for _ in range(2))
    epoch0 = batch_indices(first)
    for a, b in zip(epoch0, batch_indices(second), strict=True):
        np.testing.assert_array_equal(a, b)
    assert first.epoch == 1
    epoch1 = batch_indices(first)
    assert not np.array_equal(np.concatenate(epoch0), np.concatenate(epoch1))
    expected = np.random.default_rng([7, 1]).permutation(20)
    np.testing.assert_array_equal(np.concatenate(epoch1), expected)


def test_no_shuffle_is_arange():
    loader = ArrayLoader(make_arrays(10), batch_size=4, shuffle=False, drop_last=False)
    for _ in range(2):
        batches = batch_indices(loader)
        np.testing.assert_array_equal(np.concatenate(batches), np.arange(10))
        assert [len(b) for b in batches] == [4, 4, 2]


def test_mid_epoch_resume_reproduces_uninterrupted_run():
    arrays = make_arrays(23)
    uninterrupted = ArrayLoader(arrays, batch_size=4, seed=5)
    expected = batch_indices(uninterrupted) + batch_indices(uninterrupted)

    interrupted = ArrayLoader(arrays, batch_size=4, seed=5)
    iterator = iter(interrupted)
    taken = [next(iterator)[1] for _ in range(2)]
    state = interrupted.state_dict()
    assert state == {"epoch": 0, "batch_in_epoch": 2, "seed": 5}
    state = json.loads(json.dumps(state))

    resumed = ArrayLoader(arrays, batch_size=4, seed=0)  # the seed comes from the state
    resumed.load_state_dict(state)
    rest = batch_indices(resumed) + batch_indices(resumed)
    assert len(taken) + len(rest) == len(expected) == 10
    for got, want in zip(taken + rest, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_loop_stopping_after_len_batches_starts_next_epoch():
    loader = ArrayLoader(make_arrays(8), batch_size=4, seed=2)
    iterator = iter(loader)
    next(iterator), next(iterator)
    assert loader.state_dict() == {"epoch": 0, "batch_in_epoch": 2, "seed": 2}
    next_epoch = batch_indices(loader)
    np.testing.assert_array_equal(np.concatenate(next_epoch), np.random.default_rng([2, 1]).permutation(8))
    assert loader.epoch == 2


def test_set_epoch_resets_position():
    loader = ArrayLoader(make_arrays(12), batch_size=3, seed=4)
    next(iter(loader))
    loader.set_epoch(5)
    assert loader.state_dict() == {"epoch": 5, "batch_in_epoch": 0, "seed": 4}
    np.testing.assert_array_equal(
        np.concatenate(batch_indices(loader)), np.random.default_rng([4, 5]).permutation(12)
    )


@pytest.mark.parametrize("shuffle", [True, False])
def test_process_shards_are_disjoint_and_join_to_global_batch(shuffle):
    arrays = make_arrays(22)
    single = ArrayLoader(arrays, batch_size=6, shuffle=shuffle, seed=9, process_index=0, process_count=1)
    shards = [
        ArrayLoader(arrays, batch_size=3, shuffle=shuffle, seed=9, process_index=p, process_count=2)
        for p in range(2)
    ]
    assert len(single) == len(shards[0]) == len(shards[1]) == 3
    assert shards[0].global_batch_size == 6
    for _ in range(2):
        for whole, part0, part1 in zip(*(batch_indices(x) for x in [single, *shards]), strict=True):
            assert len(part0) == len(part1) == 3
            assert not set(part0.tolist()) & set(part1.tolist())
            np.testing.assert_array_equal(np.concatenate([part0, part1]), whole)


def test_process_remainder_split_like_array_split():
    arrays = make_arrays(11)
    options = dict(shuffle=False, drop_last=False)
    single = ArrayLoader(arrays, batch_size=6, process_index=0, process_count=1, **options)
    shards = [
        ArrayLoader(arrays, batch_size=2, process_index=p, process_count=3, **options) for p in range(3)
    ]
    assert len(single) == 2 and all(len(shard) == 2 for shard in shards)
    per_process = [batch_indices(shard) for shard in shards]
    # One full global block (0..5), then the remainder 6..10 split as np.array_split does.
    assert [batches[-1].tolist() for batches in per_process] == [[6, 7], [8, 9], [10]]
    for whole, *parts in zip(batch_indices(single), *per_process, strict=True):
        np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_dict_and_nested_pytrees_keep_structure():
    data = {"image": np.zeros((6, 2, 2)), "meta": (np.arange(6), [np.arange(6) * 10])}
    batch = next(iter(ArrayLoader(data, batch_size=4, shuffle=False)))
    assert set(batch) == {"image", "meta"}
    assert batch["image"].shape == (4, 2, 2)
    labels, (scaled,) = batch["meta"]
    np.testing.assert_array_equal(labels, np.arange(4))
    np.testing.assert_array_equal(scaled, np.arange(4) * 10)


def test_jax_arrays_are_converted_to_numpy():
    loader = ArrayLoader([jnp.arange(5)], batch_size=5, shuffle=False)
    (batch,) = next(iter(loader))
    assert isinstance(batch, np.ndarray)
    np.testing.assert_array_equal(batch, np.arange(5))
    assert loader.num_samples == 5 and loader.batch_size == 5


@pytest.mark.parametrize("batch_size", [0, -2, 2.5, True])
def test_bad_batch_size(batch_size):
    with pytest.raises(ValueError, match=rf"batch_size.*a positive integer.*{batch_size!r}"):
        ArrayLoader(make_arrays(10), batch_size=batch_size)


def test_mismatched_leading_dims_name_leaves():
    with pytest.raises(ValueError, match=r"\['y'\]: 9") as info:
        ArrayLoader({"x": np.zeros(10), "y": np.zeros(9), "z": np.zeros(10)}, batch_size=2)
    assert "['z']" not in str(info.value) and "10" in str(info.value)


def test_empty_and_scalar_pytrees():
    with pytest.raises(ValueError, match="empty"):
        ArrayLoader({}, batch_size=2)
    with pytest.raises(ValueError, match=r"\[1\]"):
        ArrayLoader((np.zeros(4), np.float32(1.0)), batch_size=2)
    with pytest.raises(ValueError, match="np.asarray"):
        ArrayLoader([[0, 1, 2, 3]], batch_size=2)


def test_too_few_samples_for_drop_last():
    with pytest.raises(ValueError, match="no batch would be produced.*12"):
        ArrayLoader(make_arrays(10), batch_size=6, process_index=0, process_count=2)
    last_rank = ArrayLoader(
        make_arrays(10), 6, shuffle=False, drop_last=False, process_index=1, process_count=2
    )
    assert len(last_rank) == 1
    assert next(iter(last_rank))[1].tolist() == list(range(5, 10))


def test_bad_process_arguments():
    with pytest.raises(ValueError, match=r"process_index.*\[0, process_count=2\).*2"):
        ArrayLoader(make_arrays(10), batch_size=2, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="both"):
        ArrayLoader(make_arrays(10), batch_size=2, process_index=0)


def test_defaults_to_jax_process():
    loader = ArrayLoader(make_arrays(10), batch_size=5)
    assert loader.global_batch_size == 5


def test_load_state_dict_validates():
    loader = ArrayLoader(make_arrays(10), batch_size=5)
    with pytest.raises(ValueError, match="batch_in_epoch"):
        loader.load_state_dict({"epoch": 0, "seed": 0})
    with pytest.raises(ValueError, match="batch_in_epoch.*7"):
        loader.load_state_dict({"epoch": 0, "batch_in_epoch": 7, "seed": 0})


def test_as_batch_iterable():
    loader = ArrayLoader(make_arrays(4), batch_size=2)
    batches = [(np.zeros(2), np.zeros(2))]
    assert as_batch_iterable(loader) is loader
    assert as_batch_iterable(batches) is batches
    with pytest.raises(TypeError, match="int.*ArrayLoader.*re-iterable"):
        as_batch_iterable(3)


def test_drop_remainder_is_drop_last_under_grains_name():
    data = np.arange(10)
    assert len(ArrayLoader(data, batch_size=4, shuffle=False, drop_remainder=True)) == 2
    kept = ArrayLoader(data, batch_size=4, shuffle=False, drop_remainder=False)
    assert [batch.tolist() for batch in kept] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # two processes: each takes its share of every global batch, the remainder split evenly
    shares = [list(ArrayLoader(data, batch_size=2, shuffle=False, drop_remainder=False, process_index=p,
                               process_count=2)) for p in (0, 1)]
    assert [b.tolist() for b in shares[0]] == [[0, 1], [4, 5], [8]]
    assert [b.tolist() for b in shares[1]] == [[2, 3], [6, 7], [9]]
