"""Packages whose public names are imported on first use (PEP 562), so that importing the package, or one
light submodule of it, does not import its heavy ones (torch, the kernels, transformers).

Ray imports an actor class's module in every process that receives a handle to that actor, so what a
module imports at its top is paid by each relay and the coordinator too; they hold no model and need
neither torch nor transformers.
"""

from __future__ import annotations

import importlib


def exports(package: str, names: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package``: each of ``names`` (public name -> the submodule, relative
    to ``package``, that defines it) is imported on first use; any other attribute that names a submodule
    imports it (``package.kernels``)."""
    module = importlib.import_module(package)

    def __getattr__(name: str):
        if name in names:
            value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise  # the submodule exists and lacks a dependency
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(names))

    return __getattr__, __dir__
