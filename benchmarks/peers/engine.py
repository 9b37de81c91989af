"""The engine every peer's receiver must leave holding the new version: a ``torch`` module and its loader.

The loader is the module's own ``load_state_dict`` (for the AdamW cases a ``transformers`` model's, which
is ``torch.nn.Module``'s): the bench's stand-in for a serving runtime's ``load_weights``. SkyRL's receiver
reloads every tensor through it; vLLM's sparse patches go through it under vLLM's NaN-masking ``copy_``;
dcr_ray's receivers write in place instead. Every check is on integer views of the parameters' bits.
"""

from __future__ import annotations

from typing import Iterable, Mapping


class Engine:
    """A module's named parameters as the tensors a receiver writes, with its loader."""

    def __init__(self, module):
        self.module = module
        self.params = dict(module.named_parameters())

    def views(self) -> dict:
        """Flat integer views of every parameter (writes through them change the engine)."""
        from dcr_ray.codec import bits_view

        return {n: bits_view(p) for n, p in self.params.items()}

    def hold(self, bits: Mapping) -> None:
        """Set the named tensors to ``bits`` (flat integer arrays), in place, untimed by callers."""
        views = self.views()
        for n, b in bits.items():
            views[n][:] = b

    def snapshot(self, names: Iterable[str]) -> dict:
        """Copies of the bits of ``names``."""
        views = self.views()
        return {n: views[n].copy() for n in names}

    def holds(self, bits: Mapping) -> bool:
        """Whether every named tensor holds exactly ``bits`` (flat integer arrays or tensors), on integer views."""
        import numpy as np

        from dcr_ray.codec import bits_view

        views = self.views()
        return all(np.array_equal(views[n], b if isinstance(b, np.ndarray) else bits_view(b)) for n, b in bits.items())

    def load_state_dict(self, tensors: Mapping) -> None:
        """The engine's loader: copy every given tensor into its parameter (names it does not know are an error)."""
        missing = set(tensors) - set(self.params)
        if missing:
            raise KeyError(f"the engine has no tensors named {sorted(missing)[:5]}")
        self.module.load_state_dict(dict(tensors), strict=False)

    def load_weights(self, weights: Iterable) -> set:
        """vLLM's ``model.load_weights`` contract on the same loader: ``(name, tensor)`` pairs, loaded names back."""
        weights = dict(weights)
        self.load_state_dict(weights)
        return set(weights)
