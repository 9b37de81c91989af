"""vLLM's trainer side: a vLLM-style trainer sends its weights through the ``dcr`` weight-transfer
backend without a dcr_ray topology (:mod:`~dcr_ray.integrations.vllm.trainer`)."""
