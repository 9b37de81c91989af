"""A worker receiver's start-up checks: each path a refit writes through must give what a fresh load gives.

Run once, right after the engine loaded its checkpoint, by
:meth:`~dcr_ray.engines.vllm.worker.receiver.MirrorReceiver.check_reload_is_a_fresh_load`, before the
receiver takes any frame. Each compares :func:`~dcr_ray.engines.vllm.worker.served.served_fingerprint`
(every parameter and buffer on integer views, and what every linear and LM-head layer's own kernel computes
on a probe input) and puts back what it changed from a
:class:`~dcr_ray.engines.vllm.worker.served.ServedSnapshot`, proven by the same fingerprint: a check never
leaves the worker serving anything but its start-up weights.

:func:`stale_captures` (the capture path: writes straight into live storage)
    The captured tensors are given other bits (a high mantissa bit of every element flipped) twice: once
    written through their captured loader copies, once reloaded through vLLM's own loader and post-load
    processing (a fresh load, in place). Where the two fingerprints differ, a layer computes from something
    the captured writes do not reach (a packed copy made at load: vLLM-CPU's packed GEMMs, prepacked MoE
    experts, an LM head packed from its tied embedding); the checkpoint tensors that write into that
    layer's storage are named, and the receiver sends them through the reload path instead. A change that
    no captured tensor explains refuses the start.
:func:`check_reload` (the mirror path: vLLM's in-place reload of whole fused groups)
    The checkpoint's own bits go through the reload; if anything served moves, that reload is not a fresh
    load (vLLM's CPU fused-MoE reload skips its experts' prepack, for one) and the start is refused, with
    what was served put back first.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch

from dcr_ray.codec import DecodedItem, Encoding
from dcr_ray.engines.vllm.checkpoint import iter_checkpoint
from dcr_ray.engines.vllm.worker.groups import reload_groups
from dcr_ray.engines.vllm.worker.served import ServedSnapshot, served_fingerprint
from dcr_ray.engines.vllm.worker.storage import int_view
from dcr_ray.errors import BackendError

#: The bit :func:`stale_captures` flips in every element, per element width: the highest mantissa bit of
#: BF16 / FP32 (a change no rounding hides), a high bit otherwise.
_FLIP = {1: 0x40, 2: 0x40, 4: 0x40 << 16, 8: 0x40 << 48}


def _differ(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def put_back(model: torch.nn.Module, snapshot: ServedSnapshot, before: dict[str, str], why: str) -> None:
    """Restore what the worker served when ``before`` was taken; :class:`BackendError` if the restored
    worker does not fingerprint as it did (it must then be restarted)."""
    snapshot.restore()
    differ = _differ(before, served_fingerprint(model))
    if differ:
        raise BackendError(f"the start-up check ({why}) could not put back what this worker served: "
                           f"{len(differ)} tensor(s) or layer(s) differ (e.g. {differ[:4]}); it no longer serves "
                           f"its start-up weights; restart the engine")


def _flipped(t: torch.Tensor) -> torch.Tensor:
    out = t.detach().contiguous().clone()
    v = int_view(out)
    v ^= _FLIP[out.element_size()]
    return out


def _written_by(model: torch.nn.Module, key: str) -> list[torch.Tensor]:
    """The tensors behind one fingerprint key: a parameter or buffer, or a probed layer's own parameters."""
    if key.startswith("probe:"):
        path = key[len("probe:"):]
        mod = model.get_submodule(path) if path else model
        return list(mod.parameters(recurse=False))
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return [tensors[key]] if key in tensors else []


def stale_captures(model: torch.nn.Module, vllm_config: Any, capture: Any, files: Sequence[str],
                   names: Iterable[str]) -> dict[str, str]:
    """``name -> reason`` of the captured tensors (``names``: whole fused groups, written through ``capture``,
    a :class:`~dcr_ray.engines.vllm.worker.capture.LoaderCapture`) whose captured writes do not give what
    vLLM's own load of the same bits gives (see the module docstring). Writes nothing in the end.
    :class:`BackendError` when the two loads differ somewhere no captured tensor writes."""
    names = set(names)
    if not names:
        return {}
    before = served_fingerprint(model)
    snapshot = ServedSnapshot(model)
    failed = None

    def other():  # the checkpoint's tensors with other bits, one at a time, in checkpoint order
        return ((n, _flipped(t)) for n, t in iter_checkpoint(files, names))

    try:
        for n, t in other():
            capture.apply([DecodedItem(n, Encoding.DENSE, 0, t.numel(), None, int_view(t).reshape(-1).numpy())])
        written = served_fingerprint(model)
        reload_groups(model, vllm_config, other(), names=sorted(names))
        loaded = served_fingerprint(model)
    except BaseException as e:
        failed = e
        raise
    finally:
        try:
            put_back(model, snapshot, before, "captured writes against vLLM's own load")
        except BackendError:
            if failed is None:
                raise
    stale: dict[str, str] = {}
    unexplained = []
    for key in _differ(written, loaded):
        writers = capture.writers_of(_written_by(model, key))
        if not writers:
            unexplained.append(key)
        for n in writers:
            stale.setdefault(n, f"a captured write does not reach what {key.removeprefix('probe:')} computes "
                                f"with (a copy made at load, e.g. a packed kernel); it goes through vLLM's reload")
    if unexplained:
        raise BackendError(f"init refused, nothing served changed: writing captured tensors and loading the same "
                           f"bits through vLLM's loader differ in {len(unexplained)} tensor(s) or layer(s) no "
                           f"captured tensor writes (e.g. {unexplained[:4]}); start the engine with mode='mirror'")
    return stale


def check_reload(model: torch.nn.Module, vllm_config: Any, items: list[tuple[str, torch.Tensor]],
                 refused: Callable[[list[str]], str]) -> None:
    """Reload ``items`` (the checkpoint's own bits, whole fused groups) through the mirror path's reload;
    if anything served changes, put back what was served and raise :class:`BackendError` with
    ``refused(changed keys)``. Writes nothing in the end."""
    before = served_fingerprint(model)
    snapshot = ServedSnapshot(model)
    try:
        reload_groups(model, vllm_config, items)
        after = served_fingerprint(model)
    except BaseException as e:
        put_back(model, snapshot, before, f"the reload raised {type(e).__name__}: {e}")
        raise
    changed = _differ(before, after)
    if changed:
        put_back(model, snapshot, before, f"the reload changed {len(changed)} served tensor(s) or layer(s)")
        raise BackendError(refused(changed))
