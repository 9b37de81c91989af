"""What runs inside each vLLM worker: the ``dcr`` backend of vLLM's weight-transfer API (``transfer``), the
worker's receiver (``receiver``: a host mirror that takes frames and reloads whole fused groups), the
fused groups and the post-load steps a reload must run (``groups``), loader capture and its data model
(``capture``, ``plan``), live storage as bits (``storage``), what a worker serves (``served``), how the
ranks of one engine agree on an outcome (``ranks``) and a digest request's checks (``verify_request``)."""
