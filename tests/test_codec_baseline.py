"""BaselineStore: committed bits, one pending set, promote/discard, memory-mapped or in memory."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dcr_ray.codec import BaselineStore
from dcr_ray.errors import BaselineError

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(_INT[a.element_size()]), b.view(_INT[b.element_size()]))


@pytest.fixture(params=["mmap", "in_memory"])
def store(request, tmp_path):
    s = BaselineStore(in_memory=request.param == "in_memory", chunk_elems=16,
                      directory=None if request.param == "in_memory" else str(tmp_path / "baseline"))
    yield s
    s.close()


def bumped(t: torch.Tensor, every: int = 7) -> torch.Tensor:
    out = t.clone()
    out.view(_INT[t.element_size()]).view(-1)[::every] ^= 1
    return out


def test_a_memory_mapped_store_keeps_bits_in_files_and_an_in_memory_store_does_not(store, tmp_path):
    store.add("w", torch.randn(4, 8).to(torch.bfloat16))
    if store.in_memory:
        assert not isinstance(store.bits("w"), np.memmap)
    else:
        assert isinstance(store.bits("w"), np.memmap)
        assert os.listdir(tmp_path / "baseline")
    assert store.nbytes == 64 and store.meta("w") == ("bfloat16", (4, 8)) and "w" in store


def test_promote_makes_the_baseline_equal_the_new_bits(store):
    old = torch.randn(3, 50).to(torch.bfloat16)
    new = bumped(old)
    store.add("w", old)
    store.begin(1)
    td = store.diff("w", new)
    store.add_pending(td)
    assert store.pending_version == 1
    (kept,) = store.pending()
    assert [(c.lo, c.hi, c.count, c.loc) for c in kept.chunks] == [(c.lo, c.hi, c.count, c.loc) for c in td.chunks]
    assert all(k.new is c.new and k.xor is None and k.ctx is None for k, c in zip(kept.chunks, td.chunks)), \
        "pending keeps positions and new bits (shared), no XOR masks"
    assert all(c.xor is not None for c in td.chunks), "the diff handed in is not changed"
    assert same_bits(store.tensor("w"), old), "staging does not touch the committed bits"
    assert store.promote(1) == td.changed > 0
    assert store.version == 1 and store.pending_version is None
    assert same_bits(store.tensor("w"), new)
    assert store.diff("w", new).changed == 0


def test_discard_leaves_the_committed_bits_and_version_unchanged(store):
    old = torch.randn(70).to(torch.float32)
    store.add("w", old)
    store.begin(1)
    store.add_pending(store.diff("w", bumped(old, 3)))
    store.discard()
    assert store.version == 0 and store.pending() == [] and store.pending_version is None
    assert same_bits(store.tensor("w"), old)
    with pytest.raises(BaselineError):
        store.promote(1)


def test_a_repeated_promote_of_the_committed_version_is_a_no_op(store):
    old = torch.arange(20, dtype=torch.int32)
    store.add("w", old)
    store.begin(1)
    store.add_pending(store.diff("w", bumped(old)))
    store.promote(1)
    assert store.promote(1) == 0 and store.version == 1


def test_begin_must_move_past_the_committed_version(store):
    store.add("w", torch.zeros(4))
    with pytest.raises(BaselineError):
        store.begin(0)
    store.begin(2)
    store.begin(3)  # a newer attempt replaces the older pending set
    assert store.pending_version == 3
    with pytest.raises(BaselineError):
        store.promote(2)


def test_add_pending_before_begin_is_a_baseline_error(store):
    store.add("w", torch.zeros(4))
    with pytest.raises(BaselineError):
        store.add_pending(store.diff("w", torch.ones(4)))


def test_an_unknown_tensor_name_is_a_baseline_error(store):
    with pytest.raises(BaselineError):
        store.diff("nope", torch.zeros(3))
    with pytest.raises(BaselineError):
        store.bits("nope")


def test_a_tensor_with_a_different_shape_than_its_baseline_is_refused(store):
    store.add("w", torch.zeros(8))
    with pytest.raises(BaselineError, match="float32\\[8\\] but the tensor is float32\\[9\\]"):
        store.diff("w", torch.zeros(9))
    with pytest.raises(BaselineError, match="int32"):
        store.diff("w", torch.zeros(8, dtype=torch.int32))  # same element size, other dtype


def test_re_adding_a_tensor_name_does_not_alias_another_tensors_baseline(store):
    store.add("a", torch.full((4,), 1.0))
    store.add("a", torch.full((4,), 2.0))  # e.g. a re-bootstrap of one tensor
    store.add("b", torch.full((4,), 3.0))
    assert same_bits(store.tensor("a"), torch.full((4,), 2.0))
    assert same_bits(store.tensor("b"), torch.full((4,), 3.0))


def test_empty_and_scalar_tensors_have_baselines(store):
    store.add("empty", torch.zeros(0, 5, dtype=torch.bfloat16))
    store.add("scalar", torch.tensor(1.5, dtype=torch.float64))
    store.begin(1)
    store.add_pending(store.diff("empty", torch.zeros(0, 5, dtype=torch.bfloat16)))
    store.add_pending(store.diff("scalar", torch.tensor(-1.5, dtype=torch.float64)))
    assert store.promote(1) == 1
    assert same_bits(store.tensor("scalar"), torch.tensor(-1.5, dtype=torch.float64))
    assert store.tensor("empty").shape == (0, 5)


def test_the_store_keeps_its_own_copy_of_the_bits(store):
    t = torch.zeros(10)
    store.add("w", t)
    t += 1  # the trainer keeps stepping in place
    assert same_bits(store.tensor("w"), torch.zeros(10))
    assert store.diff("w", t).changed == 10


def test_closing_a_store_with_a_private_directory_removes_it():
    s = BaselineStore()
    s.add("w", torch.ones(8))
    d = s.directory
    assert os.path.isdir(d)
    s.close()
    assert not os.path.exists(d)


@pytest.mark.parametrize("seed", range(12))
def test_promote_writes_only_changes_and_leaves_the_bits_of_a_dense_rewrite(seed, tmp_path):
    from dcr_ray.codec.encoding.baseline import write_changes

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5000))
    dtype = [torch.bfloat16, torch.float32, torch.int16, torch.uint8][seed % 4]
    old = torch.from_numpy(rng.integers(0, 255, size=n * dtype.itemsize, dtype=np.uint8)).view(dtype).clone()
    new = old.clone()
    rate = [0.0005, 0.01, 0.3, 0.95, 1.0][seed % 5]  # sparse chunks, and chunks the diff keeps DENSE
    iv = new.view(_INT[dtype.itemsize])
    hit = torch.from_numpy(rng.random(n) < rate)
    iv[hit] ^= torch.from_numpy(rng.integers(1, 127, size=int(hit.sum()), dtype=np.int64)).to(iv.dtype)
    s = BaselineStore(directory=str(tmp_path / "b"), chunk_elems=int(rng.integers(8, 600)))
    try:
        s.add("w", old)
        s.begin(1)
        td = s.diff("w", new)
        s.add_pending(td)
        dense_rewrite = np.array(s.bits("w"))
        for ch in td.chunks:  # what promote used to do: every DENSE chunk rewritten whole
            dense_rewrite[ch.lo:ch.hi] = ch.dense if ch.is_dense else dense_rewrite[ch.lo:ch.hi]
            if not ch.is_dense:
                dense_rewrite[ch.positions()] = ch.new
        s.promote(1)
        assert np.array_equal(s.bits("w"), dense_rewrite)
        assert same_bits(s.tensor("w"), new)
        # a DENSE chunk writes only the elements that differ: an unchanged element is never stored again
        probe = np.array(old.view(_INT[dtype.itemsize]).numpy().view(s.bits("w").dtype))
        written = np.zeros(n, bool)

        class Spy(np.ndarray):
            def __setitem__(self, key, value):
                written[np.arange(n)[key]] = True
                super().__setitem__(key, value)

        spy = probe.view(Spy)
        for ch in td.chunks:
            write_changes(spy, ch)
        assert np.array_equal(probe, dense_rewrite)
        assert not written[~hit.numpy()].any()
    finally:
        s.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="dirty pages are read from Linux smaps")
def test_a_promote_dirties_only_the_pages_that_hold_a_change(tmp_path):
    from benchmarks.refit.pages import dirty_pages, write_back

    n = 16 << 20  # 32 MiB of BF16, 8192 pages: large enough that readahead would build large folios here
    old = torch.randn(n).to(torch.bfloat16)
    new = old.clone()
    pos = torch.arange(0, n, n // 20 + 5)[:20]  # 20 changes, each on its own page
    new.view(torch.int16)[pos] ^= 1
    s = BaselineStore(directory=str(tmp_path / "b"), chunk_elems=1 << 20)
    try:
        s.add("w", old)
        s.begin(1)
        s.add_pending(s.diff("w", new))
        assert s.pending_pages() == 20
        write_back(s.bits(x) for x in s.names())
        assert dirty_pages(s.directory) == 0
        s.promote(1)
        assert 20 <= dirty_pages(s.directory) <= 30  # <= 1.5x the pages that hold a change, of 8192
        assert same_bits(s.tensor("w"), new)
    finally:
        s.close()
