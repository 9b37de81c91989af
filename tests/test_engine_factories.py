"""Engine factories build their backends from what a user has: a checkpoint directory or a model factory."""

from __future__ import annotations

import pytest
import torch

import dcr_ray
from dcr_ray.errors import ConfigError
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint


def test_an_hf_engine_loads_a_checkpoint_directory_bit_for_bit(tmp_path):
    model = build_model(ModelSpec(seed=2))
    save_checkpoint(model, str(tmp_path))
    backend = dcr_ray.HFEngine(str(tmp_path))()
    want = dcr_ray.checkpoint_state_dict(model)
    got = backend.tensors()
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), n


def test_a_model_spec_is_a_factory_and_with_seed_changes_only_the_initial_bits():
    spec = ModelSpec(seed=1)
    a, b = dcr_ray.HFEngine(spec)().tensors(), dcr_ray.HFEngine(spec.with_seed(5))().tensors()
    assert set(a) == set(b) and spec.with_seed(5).arch == spec.arch
    assert any(not torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def test_an_hf_engine_refuses_what_is_neither_a_directory_nor_a_factory():
    with pytest.raises(ConfigError, match="checkpoint directory or a callable"):
        dcr_ray.HFEngine(42)
