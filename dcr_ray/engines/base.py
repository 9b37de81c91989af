"""The engine backend contracts: how a receiver exposes canonical tensors and takes validated frames.

A backend describes its weights in *canonical coordinates* (Hugging Face checkpoint names, flat
element indices) so that, after :meth:`EngineBackend.flush`, the serving runtime holds exactly what a
dense load of the same canonical tensors through its own loader would give. There are two kinds, each a
base class declaring only what it implements:

:class:`TensorBackend`
    holds the canonical tensors in this process and applies decoded frames into them (a ``transformers``
    model: its parameters *are* the canonical tensors). It can be read back, digested, copied to a peer,
    and rolled back from the engine's undo record.
:class:`WireBackend`
    forwards the validated frames' wire bytes to a runtime of its own, which validates them again and
    writes them where it serves from (vLLM workers; adopted engines through vLLM's weight-transfer API).
    It may keep its own undo record (:meth:`EngineBackend.rollback`) and may be able to read its tensors
    back (:meth:`WireBackend.read_back`; an adopted engine cannot).

Call order within one transfer (driven by the engine actor)::

    tensor_specs()            # once; frames are validated against it before they are written
    apply(frame) ...          # TensorBackend: in declared payload order, each write in place
                              # (apply_with_undo while the engine keeps an undo record of the transfer)
    apply_wire(bytes, frame)  # WireBackend: instead of apply
    flush()                   # make writes visible to the runtime (may push through the loader)
    # commit record written -> the engine activates the new version

A dense bootstrap sends dense frames through the same protocol; :meth:`TensorBackend.load_dense` takes a
peer's copy. A backend that implements :meth:`EngineBackend.matches_digests` (vLLM engines) is first
asked whether it already serves the committed version; if so it joins without a dense bootstrap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterable, Mapping

from dcr_ray.codec import DecodedFrame
from dcr_ray.codec.bits import wire_name
from dcr_ray.codec.decoding.undo import FrameUndo
from dcr_ray.engines.steps import OPEN, StepGate

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


def canonical_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The canonical tensors of a ``transformers`` model: ``state_dict()`` without tied duplicates.

    Tied weights (e.g. ``lm_head.weight`` sharing ``model.embed_tokens.weight``) appear once, under the
    first name ``state_dict`` lists, as in a saved safetensors checkpoint. The tensors are the model's
    own storage (``keep_vars`` detached views), so writes through them change the model in place.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (id(t), 0)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def checkpoint_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` under the names and shapes its saved checkpoint has: what owners send.

    Canonical coordinates are the Hugging Face *checkpoint* layout (what ``save_pretrained`` writes and
    what a vLLM engine loads). ``transformers`` 5 holds some weights in another layout in memory: an
    MoE layer keeps all experts fused in ``mlp.experts.gate_up_proj`` / ``down_proj``, while the
    checkpoint has ``mlp.experts.<i>.gate_proj.weight`` and so on. This applies ``transformers``' own
    reverse conversion (the one ``save_pretrained`` runs), so no per-model rule lives here. Tensors the
    conversion leaves alone are the model's storage (as in :func:`canonical_state_dict`); converted
    ones are new tensors.
    """
    state = canonical_state_dict(model)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 holds every model in checkpoint layout
        return state
    return dict(revert_weight_conversion(model, state))


class EngineBackend(ABC):
    """What every receiver declares (see the module docstring); subclass :class:`TensorBackend` or
    :class:`WireBackend`, never this class directly."""

    #: Whether ``apply`` takes frames with packs of small tensors (``frame.packs``, written by
    #: :func:`~dcr_ray.codec.apply_decoded`); otherwise the engine expands them into per-tensor items.
    applies_packs: bool = False
    #: Whether ``generate`` decodes step by step through :attr:`step_gate` (:mod:`~dcr_ray.engines.steps`),
    #: so a version switch can fall between two steps of a running request; otherwise the engine drains.
    switches_in_flight: bool = False
    #: What every decoding step passes through (:data:`~dcr_ray.engines.steps.OPEN` until an engine gates it).
    step_gate: StepGate = OPEN

    def gate_steps(self, gate: StepGate) -> None:
        """From now on every decoding step of :meth:`generate` passes through ``gate`` (the engine actor's,
        with ``EngineConfig(switch="in_flight")``); only for backends that declare ``switches_in_flight``."""
        self.step_gate = gate

    @abstractmethod
    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Canonical name -> (wire dtype, shape): what every frame is validated against."""

    def flush(self) -> None:
        """Make every write since the last flush visible to the serving runtime (default: nothing)."""

    def activate(self, version: int) -> None:
        """The engine now holds committed ``version`` (its record is durable): a backend that tags its
        outputs with a version moves the tag here (default: nothing)."""

    def abandon(self) -> None:
        """Close an update this backend holds open of its own, without applying it: the engine's transfer
        was abandoned (default: nothing)."""

    def rollback(self) -> bool:
        """Undo, in place, every write of the transfer the engine abandons, from an undo record this
        backend keeps itself (the engine asks when it kept none of its own): True when the runtime serves
        the committed version again; False (the default) when it cannot, and the engine is then
        bootstrapped densely."""
        return False

    def describe(self) -> dict:
        """How this backend receives, for ``status()`` (a vLLM engine: the path its workers write through,
        ``capture`` or ``mirror``, and how many tensors take each); empty by default."""
        return {}

    def matches_digests(self, version: int, digests: Mapping[tuple, str]) -> bool | None:
        """Whether this engine already serves committed ``version``, shown by digest (optional).

        ``digests``: ``{(name, start, stop): hex}``, the owners' committed box digests
        (:mod:`dcr_ray.sharding.digest`). True: every box matches, the engine joins at ``version`` without
        a dense bootstrap. False: it does not (or cannot show it): bootstrap densely. None (the default):
        this backend does not check, so joining engines are bootstrapped densely.
        """
        return None

    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int = 8, sampling=None) -> list[dict]:
        """Continuations per prompt ``{"token_ids", "logprobs"}``: greedy by default, else as ``sampling``
        (:class:`~dcr_ray.engines.sampling.Sampling`) says; a backend that ``switches_in_flight`` adds
        ``versions``, the spans of the versions its steps read (:mod:`~dcr_ray.engines.steps`). A backend
        that serves overrides it; the default says this one does not."""
        from dcr_ray.errors import BackendError

        raise BackendError(f"{type(self).__name__} does not generate")

    def close(self) -> None:
        """Release the runtime (default: nothing)."""


class TensorBackend(EngineBackend):
    """A receiver that holds the canonical tensors in this process and applies decoded frames into them."""

    @abstractmethod
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Canonical name -> tensor holding the engine's canonical bits (CPU, contiguous).

        For runtimes whose storage is bit-addressable in canonical layout this is the live storage;
        otherwise a host mirror that :meth:`flush` pushes through the runtime's loader.
        """

    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in self.tensors().items()}

    @abstractmethod
    def apply(self, frame: DecodedFrame) -> None:
        """Write a validated frame in place."""

    def apply_with_undo(self, frame: DecodedFrame, undo: FrameUndo) -> None:
        """Write a validated frame in place (as :meth:`apply`) and keep in ``undo`` the bits every write
        replaces; called instead of :meth:`apply` while the engine keeps an undo record (only when
        :meth:`undo_tensors` is not None). ``undo`` is already in the engine's record, so it must cover
        every write this makes even when it fails part-way.

        The default reads the replaced bits back from :meth:`undo_tensors` before :meth:`apply` (two
        passes over the changed positions, right however much :meth:`apply` then writes). A backend
        whose writes are :func:`~dcr_ray.codec.apply_decoded`'s into those tensors passes ``undo`` on
        (``apply_decoded(frame, tensors, undo=undo)``): one pass, each inverse entering ``undo`` as its
        write returns."""
        undo.read_back(frame, self.undo_tensors())
        self.apply(frame)

    def undo_tensors(self) -> Mapping[str, torch.Tensor] | None:
        """The tensors :meth:`apply` writes, readable at any position, for the engine's undo record
        (in-place rollback of an abandoned transfer); None when reading them is not cheap or not
        possible (then an abandoned transfer leaves the engine dirty, to be re-bootstrapped densely)."""
        return None

    @abstractmethod
    def load_dense(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named tensors' bits completely (a peer's copy)."""


class WireBackend(EngineBackend):
    """A receiver that forwards validated wire frames to a runtime of its own, which validates them again."""

    @abstractmethod
    def apply_wire(self, data: bytes, frame: DecodedFrame) -> None:
        """Forward one validated frame as its wire bytes (``frame``: the same frame decoded, for its meta)."""

    def read_back(self) -> Mapping[str, torch.Tensor] | None:
        """The canonical tensors the runtime serves, read back (for checks, digests and a peer's copy), or
        None (the default) when this backend cannot read them (an adopted engine: vLLM's public calls do
        not return weights; compare its outputs and ``get_weight_version()`` instead)."""
        return None

    def load_dense(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named tensors' bits completely (a peer's copy), through the runtime. The default
        raises :class:`~dcr_ray.errors.BackendError`: such a backend takes dense bits only as frames of a
        refit (a dense bootstrap through the protocol), so a peer's copy cannot reach it."""
        from dcr_ray.errors import BackendError

        raise BackendError(f"{type(self).__name__} takes dense bits only as frames of a refit, not a peer's copy")


def readable_tensors(backend: EngineBackend) -> Mapping[str, torch.Tensor]:
    """The canonical tensors ``backend`` holds or can read back; :class:`~dcr_ray.errors.BackendError` for a
    backend that cannot show them."""
    from dcr_ray.errors import BackendError

    if isinstance(backend, TensorBackend):
        return backend.tensors()
    got = backend.read_back() if isinstance(backend, WireBackend) else None
    if got is None:
        raise BackendError(f"{type(backend).__name__} cannot read the weights it serves back (e.g. an adopted "
                           f"vLLM engine); compare its outputs and get_weight_version() instead")
    return got
