"""Measurement helpers every benchmark shares, written once: a text table's rows, the engine factory of a
benchmark topology (``transformers`` or vLLM on CPU), and one AdamW step of a toy model. Heavy imports
(torch, transformers, vLLM) stay inside the functions."""

from __future__ import annotations


def text_rows(cols, rows) -> list[str]:
    """A text table: ``cols`` is ``(header, width, format)`` per column (the first left-aligned, the others
    right-aligned), ``rows`` the values per row (``None`` prints ``-``)."""
    out = [" ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w, _) in enumerate(cols))]
    for vals in rows:
        cells = ["-" if v is None else f.format(v) for (_, _, f), v in zip(cols, vals)]
        out.append(" ".join(c.rjust(w) if i else c.ljust(w) for i, ((_, w, _), c) in enumerate(zip(cols, cells))))
    return out


def bench_engine(receiver: str, spec, seed: int, prefix: str) -> tuple[object, list[str]]:
    """The engine factory of a benchmark's engines: ``receiver="vllm"``, a vLLM engine over a checkpoint of
    ``spec`` at ``seed`` written to a temporary directory (named ``prefix``...; ``"vllm_capture"``: its weights
    unpacked, dcr_ray's capture path), else a ``transformers`` engine of it; the dense bootstrap then gives every
    engine the owners' bits. Returns the factory and the directories to remove afterwards."""
    import dcr_ray
    from dcr_ray.testing.models import build_model, save_checkpoint

    if not receiver.startswith("vllm"):
        return dcr_ray.HFEngine(spec.with_seed(seed)), []
    import tempfile

    from dcr_ray.engines.vllm import VllmEngine

    ckpt = tempfile.mkdtemp(prefix=prefix)
    save_checkpoint(build_model(spec.with_seed(seed)), ckpt)
    return VllmEngine(ckpt, cpu_weights="unpacked" if receiver == "vllm_capture" else "packed"), [ckpt]


def adamw_step(model, opt, ids) -> float:
    """One optimizer step of a causal LM on ``ids`` (its own labels); returns the loss."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()
