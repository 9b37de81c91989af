"""Every package's ``__init__`` names, in its docstring, every module and subpackage it holds: a new module
cannot land without its package saying what it is for. Read from the source with ``ast``, no imports run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "dcr_ray"


def _packages() -> list[Path]:
    return sorted(p.parent for p in LIBRARY.rglob("__init__.py") if "__pycache__" not in p.parts)


def _held(package: Path) -> list[str]:
    """The modules (``name.py`` but ``__init__``) and subpackages (a folder with an ``__init__.py``) directly
    in ``package``."""
    return sorted(p.stem for p in package.iterdir()
                  if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file())


def _names(doc: str, name: str) -> bool:
    """The docstring names ``name`` as code, not as a plain word (``state`` the module, not "its state"): as a
    dotted path's part (``.name``, ``dcr_ray.pkg.name``), in backticks, or as ``name.py`` / ``name/``."""
    return re.search(rf"[.`]{re.escape(name)}(?![\w])|(?<![\w]){re.escape(name)}(?:\.py\b|/|`)",
                     doc) is not None


def _unnamed() -> dict[str, list[str]]:
    out = {}
    for package in _packages():
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        missing = [m for m in _held(package) if not _names(doc, m)]
        if missing:
            out[str(package.relative_to(LIBRARY.parent))] = missing
    return out


def test_every_package_docstring_names_every_module_and_subpackage_it_holds():
    unnamed = _unnamed()
    assert not unnamed, f"package docstrings that leave out modules they hold: {unnamed}"


def test_a_module_is_named_only_as_code_not_as_a_plain_word():
    assert _names(":mod:`.local`  shards", "local") and _names("``state``", "state")
    assert _names("see :mod:`dcr_ray.engines.vllm.batch`", "batch") and _names("state.py holds", "state")
    assert _names("``worker/`` (inside vLLM)", "worker") and _names(":func:`~dcr_ray.failpoints.remote.arm`", "remote")
    assert not _names("the engine's state and phase", "state")
    assert not _names("``kernels_numba``", "kernels") and not _names("``ptrkernels``", "kernels")
