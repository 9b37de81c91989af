"""Backend ``dcr`` on a vLLM release dcr_ray does not support: every name of this module raises
:class:`~dcr_ray.errors.UnsupportedRuntimeError` naming the supported range.

The plugin (:func:`~dcr_ray.engines.vllm.plugin.register_unsupported`) registers this module in vLLM's
weight-transfer registries in place of the real engines, which vLLM loads lazily by module and class name: the
error comes when an engine or a trainer asks for ``backend="dcr"``, and never to a vLLM process that does not.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name.startswith("__"):  # import machinery and introspection (``__path__``, ``__spec__``, ...)
        raise AttributeError(name)
    from dcr_ray.engines.vllm.compat import check_vllm_version

    check_vllm_version()  # raises UnsupportedRuntimeError naming the range
    raise AttributeError(name)  # a supported vLLM never reaches this module: the plugin registers the real engines
