"""Adapters that plug dcr_ray into the RL pipelines users already run.

Each subpackage targets one framework and imports it lazily, so ``import dcr_ray`` never needs it:
``dcr_ray.integrations.verl`` (veRL's checkpoint-engine registry) and
``dcr_ray.integrations.openrlhf`` (a recipe replacing OpenRLHF's ``broadcast_to_vllm``).
"""
