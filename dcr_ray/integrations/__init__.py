"""Adapters that plug dcr_ray into the RL pipelines users already run.

Each subpackage targets one framework and imports it lazily, so ``import dcr_ray`` never needs it:

- ``dcr_ray.integrations.verl``: veRL's ``dcr`` checkpoint engine and the manager that drives it
  (``docs/guide_verl.md``)
- ``dcr_ray.integrations.openrlhf``: a recipe replacing OpenRLHF's ``broadcast_to_vllm``
  (``docs/guide_openrlhf.md``)
- ``dcr_ray.integrations.trl``: TRL's AsyncGRPO ``weight_transfer=`` object (``docs/guide_trl.md``)
- ``dcr_ray.integrations.vllm``: the trainer side of vLLM's ``dcr`` weight-transfer backend, for a vLLM-style
  trainer without a dcr_ray topology
"""
