"""ProcessShardedLoader: each process keeps its contiguous slice of every global batch."""

import numpy as np
import pytest

from composerjax.data import ArrayLoader, ProcessShardedLoader, shard_by_process, slice_for_process


def global_batches():
    """Three global batches of 8 samples: features ``x`` and labels ``y == x``."""
    return [{"x": np.arange(start, start + 8, dtype=np.float32).reshape(8, 1), "y": np.arange(start, start + 8)}
            for start in (0, 8, 16)]


def test_each_process_yields_its_contiguous_slice_and_the_slices_make_up_the_batch():
    shares = [list(ProcessShardedLoader(global_batches(), process_index=rank, process_count=4)) for rank in range(4)]
    assert [batch["y"].tolist() for batch in shares[1]] == [[2, 3], [10, 11], [18, 19]]
    for index, batch in enumerate(global_batches()):
        np.testing.assert_array_equal(np.concatenate([share[index]["x"] for share in shares]), batch["x"])
        np.testing.assert_array_equal(np.concatenate([share[index]["y"] for share in shares]), batch["y"])
        assert shares[3][index]["x"].shape == (2, 1) and shares[3][index]["x"].dtype == np.float32


def test_defaults_to_this_process():
    loader = shard_by_process(global_batches())
    assert (loader.process_index, loader.process_count) == (0, 1)
    assert [batch["y"].tolist() for batch in loader] == [batch["y"].tolist() for batch in global_batches()]


def test_drop_remainder_drops_trailing_samples_else_names_the_batch():
    batches = [np.arange(6), np.arange(6, 13)]  # 6 then 7 samples over 3 processes
    assert [b.tolist() for b in shard_by_process(batches, process_index=2, process_count=3)] == [[4, 5], [10, 11]]
    strict = shard_by_process(batches, drop_remainder=False, process_index=0, process_count=3)
    iterator = iter(strict)
    assert next(iterator).tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"batch 1 has 7 samples, which does not divide across 3 processes; "
                                         r"pass drop_remainder=True to drop the last 1"):
        next(iterator)


def test_bad_batches_and_arguments_are_refused():
    with pytest.raises(ValueError, match=r"batch 0 has 2 samples, fewer than the 4 processes"):
        list(shard_by_process([np.arange(2)], process_index=0, process_count=4))
    with pytest.raises(ValueError, match=r"batch 0: leaves disagree on the batch size \(leading dimensions \[4, 5\]\)"):
        list(shard_by_process([(np.zeros(4), np.zeros(5))], process_index=0, process_count=2))
    with pytest.raises(ValueError, match="holds a scalar"):
        slice_for_process((np.zeros(4), np.float32(1)), 0, 2)
    with pytest.raises(ValueError, match=r"`process_index` must be in \[0, process_count=2\), got 2"):
        ProcessShardedLoader([], process_index=2, process_count=2)
    with pytest.raises(ValueError, match="pass both `process_index` and `process_count`"):
        ProcessShardedLoader([], process_index=1)
    with pytest.raises(TypeError, match="re-iterable of batches"):
        ProcessShardedLoader(42)


def test_len_and_checkpoint_state_pass_through():
    # A single-process ArrayLoader of GLOBAL batches, split across 2 processes by the wrapper.
    arrays = (np.arange(40).reshape(20, 2), np.arange(20))
    source = ArrayLoader(arrays, batch_size=4, seed=1, process_index=0, process_count=1)
    loader = ProcessShardedLoader(source, process_index=1, process_count=2)
    assert len(loader) == 5 and loader.global_batch_size == 4
    iterator = iter(loader)
    first = [next(iterator)[1].tolist() for _ in range(2)]
    state = loader.state_dict()
    assert state == source.state_dict() == {"epoch": 0, "batch_in_epoch": 2, "seed": 1}
    rest = [y.tolist() for _, y in iterator]

    resumed = ProcessShardedLoader(ArrayLoader(arrays, batch_size=4, seed=1, process_index=0, process_count=1),
                                   process_index=1, process_count=2)
    resumed.load_state_dict(state)
    assert [y.tolist() for _, y in resumed] == rest
    assert all(len(y) == 2 for y in first + rest)


def test_a_plain_list_has_no_state_to_pass_through():
    loader = shard_by_process(global_batches(), process_index=0, process_count=2)
    assert len(loader) == 3
    assert not hasattr(loader, "state_dict") and not hasattr(loader, "load_state_dict")
    assert not hasattr(loader, "global_batch_size")
    with pytest.raises(TypeError, match="the wrapped generator has no len()"):
        len(shard_by_process(batch for batch in global_batches()))
    odd = ProcessShardedLoader(ArrayLoader(np.arange(20), batch_size=5, process_index=0, process_count=1),
                               process_index=0, process_count=2)
    assert odd.global_batch_size == 4  # 5 samples, the fifth dropped


def test_one_resolve_process_serves_every_loader(monkeypatch):
    import jax

    from composerjax.data import array_loader, process_sharding
    from composerjax.data.process_sharding import resolve_process

    assert not hasattr(array_loader.ArrayLoader, "_resolve_process")
    assert array_loader.resolve_process is process_sharding.resolve_process
    assert resolve_process(2, 3) == (2, 3) and type(resolve_process(np.int64(1), 2)[0]) is int
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert resolve_process(None, None) == (1, 2)  # asked when a loader is built, not at import
    assert ArrayLoader(np.arange(8), batch_size=2).state_dict() is not None
    for index, count, message in [(0, None, "pass both"), (None, 2, "pass both"),
                                  (0, 0, "`process_count` must be a positive integer, got 0"),
                                  (-1, 2, "`process_index` must be an integer >= 0, got -1"),
                                  (True, 2, "`process_index` must be an integer >= 0, got True"),
                                  (2, 2, r"`process_index` must be in \[0, process_count=2\), got 2")]:
        with pytest.raises(ValueError, match=message):
            resolve_process(index, count)
        with pytest.raises(ValueError, match=message):
            ArrayLoader(np.arange(8), batch_size=2, process_index=index, process_count=count)
