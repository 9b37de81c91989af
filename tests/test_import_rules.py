"""The layers import only what docs/architecture.md allows (read from the source, no imports run)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dcr_ray"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(m for m in (f"{node.module}.{a.name}" for a in node.names) if _is_dcr_module(m))
    return out


def _is_dcr_module(dotted: str) -> bool:
    """``from dcr_ray.codec import bits`` imports a module; ``... import PayloadKey`` a name."""
    if not dotted.startswith("dcr_ray."):
        return False
    p = ROOT.parent.joinpath(*dotted.split("."))
    return p.is_dir() or p.with_suffix(".py").exists()


def _files(*parts: str):
    return sorted((ROOT.joinpath(*parts)).rglob("*.py"))


def _violations(files, banned) -> list[str]:
    bad = []
    for f in files:
        for mod in _imports(f):
            if any(mod == b or mod.startswith(b + ".") for b in banned):
                bad.append(f"{f.relative_to(ROOT.parent)} imports {mod}")
    return bad


def test_the_codec_imports_no_ray_no_vllm_and_no_other_dcr_ray_layer():
    assert not _violations(_files("codec"), ["ray", "vllm", "dcr_ray.actors", "dcr_ray.relay", "dcr_ray.engines"])


def test_transports_use_the_codec_only_through_its_package_and_know_no_actors_or_engines():
    bad = _violations(_files("relay"), ["dcr_ray.actors", "dcr_ray.engines", "vllm"])
    for f in _files("relay"):
        bad += [f"{f.name} imports codec internals: {m}" for m in _imports(f) if m.startswith("dcr_ray.codec.")]
    assert not bad


def test_engine_backends_do_not_know_how_frames_arrive():
    assert not _violations(_files("engines"), ["dcr_ray.actors", "dcr_ray.relay"])


def test_the_library_never_imports_its_test_tools():
    lib = [f for f in ROOT.rglob("*.py")
           if not {"testing", "bench"} & set(f.relative_to(ROOT).parts) and f.name != "cli.py"]
    assert not _violations(lib, ["dcr_ray.testing", "dcr_ray.bench"])


@pytest.mark.parametrize("module", ["dcr_ray", "dcr_ray.engines.vllm", "dcr_ray.codec"])
def test_importing_the_library_does_not_import_vllm(module):
    code = f"import sys, {module}; assert 'vllm' not in sys.modules, 'vllm was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
