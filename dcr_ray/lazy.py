"""Packages whose public names are imported on first use (PEP 562), so that importing the package, or one
light submodule of it, does not import its heavy ones (torch, the kernels, transformers).

Ray imports an actor class's module in every process that receives a handle to that actor, so what a
module imports at its top is paid by each relay and the coordinator too; they hold no model and need
neither torch nor transformers.
"""

from __future__ import annotations

import importlib
import os


def exports(package: str, names: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package``: each of ``names`` (public name -> the submodule, relative
    to ``package``, that defines it) is imported on first use; any other attribute that names a submodule
    imports it (``package.kernels``).

    A public name that is also a submodule's name cannot be lazy: once anything imports the submodule, Python
    binds the package's attribute to it, and the name would then give the module. The package imports such a
    name itself, and this refuses it."""
    module = importlib.import_module(package)
    clash = sorted(n for n in names if any(os.path.exists(os.path.join(d, f"{n}.py")) or
                                           os.path.isdir(os.path.join(d, n)) for d in module.__path__))
    if clash:
        raise ImportError(f"{package}: {clash} name submodules too; import them in the package itself")

    def __getattr__(name: str):
        if name in names:  # read from its submodule at each use, never kept here (a patch there is seen)
            return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        try:
            return importlib.import_module(f"{package}.{name}")  # which binds it here, as any import does
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise  # the submodule exists and lacks a dependency
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(names))

    return __getattr__, __dir__
