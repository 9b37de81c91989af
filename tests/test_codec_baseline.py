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
    assert store.pending_version == 1 and store.pending() == [td]
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
