"""Tests, benchmarks and examples reach the library only through its public names: the API, the
documented inspection surface (``status()``, ``EngineActor.stats()``, ``dcr_ray.testing``'s fault tools)
and module-level constants. Read from the source, no imports run.

A *private name of the library* is any ``_name`` (not a dunder) that the library defines: a function,
class or method, or an attribute it sets or reads on ``self``. Flagged in ``tests/``, ``benchmarks/`` and
``examples/``:

- ``from dcr_ray... import _name``;
- ``obj._name`` for such a name, unless ``obj`` is ``self``/``cls`` inside a class of that file whose
  library bases do not define ``_name`` (a test's own class may use its own private attributes);
- ``getattr``/``setattr``/``monkeypatch.setattr`` with such a name as a string.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "dcr_ray"
CHECKED = ("tests", "benchmarks", "examples")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _library_names() -> tuple[set[str], dict[str, set[str]], dict[str, list[str]]]:
    """Every private name, and per library class its own private names and its base classes' names."""
    names: set[str] = set()
    per_class: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for path in LIBRARY.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                names.add(node.name)
        for node in tree.body:  # module-level assignments: private functions made by a call, private state
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            names.update(t.id for t in targets if isinstance(t, ast.Name) and _private(t.id))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and _private(node.attr):
                names.add(node.attr)
            if isinstance(node, ast.ClassDef):
                own = per_class.setdefault(node.name, set())
                bases.setdefault(node.name, []).extend(_base_name(b) for b in node.bases)
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                            and sub.value.id == "self" and _private(sub.attr):
                        own.add(sub.attr)
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(sub.name):
                        own.add(sub.name)
    return names, per_class, bases


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _inherited(cls_bases: list[str], per_class: dict, bases: dict) -> set[str]:
    """The private names a class defined outside the library inherits from library classes."""
    out, todo, seen = set(), list(cls_bases), set()
    while todo:
        b = todo.pop()
        if b in seen or b not in per_class:
            continue
        seen.add(b)
        out |= per_class[b]
        todo.extend(bases.get(b, []))
    return out


def _violations(path: Path, names: set[str], per_class: dict, bases: dict) -> list[str]:
    tree = ast.parse(path.read_text())
    where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
    out = []
    # the private names this file defines itself: methods and classes, attributes it assigns on ``self``
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    defined |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")}
    # which ``self``/``cls`` nodes belong to a method of a class of this file, and what it inherits
    owned: dict[int, set[str]] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        inherited = _inherited([_base_name(b) for b in cls.bases], per_class, bases)
        for sub in ast.walk(cls):
            if isinstance(sub, ast.Name) and sub.id in ("self", "cls"):
                owned.setdefault(id(sub), set()).update(inherited)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dcr_ray"):
            out += [f"{where}:{node.lineno} imports {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and node.attr in names:
            v = node.value
            if isinstance(v, ast.Name) and id(v) in owned and node.attr in defined and node.attr not in owned[id(v)]:
                continue  # a class of this file using a private attribute of its own
            out.append(f"{where}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if called in ("getattr", "setattr", "hasattr") and node.args[1].value in names:
                out.append(f"{where}:{node.lineno} {called}(..., {node.args[1].value!r})")
    return sorted(out, key=lambda v: int(v.split(":")[1].split()[0]))


def test_tests_benchmarks_and_examples_use_no_private_name_of_the_library():
    names, per_class, bases = _library_names()
    found = [v for part in CHECKED for p in sorted((REPO / part).rglob("*.py"))
             for v in _violations(p, names, per_class, bases)]
    assert not found, "use the public API or dcr_ray.testing instead:\n" + "\n".join(found)


def test_the_check_sees_private_imports_attributes_strings_and_inherited_private_methods(tmp_path):
    names, per_class, bases = _library_names()
    assert "_dcr_held" in names and "_dcr_held" in _inherited(["OwnerMixin"], per_class, bases)
    src = tmp_path / "t.py"
    src.write_text(
        "from dcr_ray.actors.owner.held import OwnerMixin\n"
        "from dcr_ray.codec.encoding.diff import _diff_chunk\n"
        "class Mine:\n"
        "    def f(self):\n"
        "        self._dcr_held = 1\n"  # a class of this file: its own attribute
        "class Bench(OwnerMixin):\n"
        "    def f(self):\n"
        "        return self._dcr_held()\n"  # inherited from the library
        "def g(backend, monkeypatch):\n"
        "    monkeypatch.setattr(backend, '_dcr_held', None)\n"
        "    return backend._dcr_held\n"
        "def h(kernels):\n"
        "    return kernels._compiled()\n")  # a private name the library makes by assignment (once(_build))
    assert "_compiled" in names
    assert _violations(src, names, per_class, bases) == [
        "t.py:2 imports _diff_chunk", "t.py:8 ._dcr_held", "t.py:10 setattr(..., '_dcr_held')", "t.py:11 ._dcr_held",
        "t.py:13 ._compiled"]
