"""Every dotted ``dcr_ray.`` name that the library's docstrings, the benchmarks, the examples and the docs
mention resolves to a module or an object: a rename or a move cannot leave a reference behind."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bdcr_ray(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
SOURCES = [*sorted((ROOT / "dcr_ray").rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py")),
           *sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "docs").glob("*.md")),
           ROOT / "README.md", ROOT / "BENCHMARKS.md"]


def _resolves(name: str) -> bool | None:
    """True or False; None when a third-party module its import needs is missing (not this test's job)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("dcr_ray"):
                return None
            continue
        for attr in parts[i:]:
            try:  # a package's lazy __getattr__ may import a peer's package here
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            except ModuleNotFoundError as e:
                if e.name and not e.name.startswith("dcr_ray"):
                    return None
                raise
        return True
    return False


def test_every_dotted_dcr_ray_name_in_the_code_and_docs_resolves():
    named: dict[str, set[str]] = {}
    for path in SOURCES:
        for m in NAME.findall(path.read_text(errors="replace")):
            if not m.endswith(("_py", ".py", ".md", ".json")):
                named.setdefault(m, set()).add(str(path.relative_to(ROOT)))
    stale = {n: sorted(where)[:3] for n, where in sorted(named.items()) if _resolves(n) is False}
    assert not stale, f"names that resolve to nothing: {stale}"
