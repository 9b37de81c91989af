"""``dcr-ray bench peers``: the peers side by side on the same optimizer steps, through their own code where
it runs here.

Data (:mod:`.data`), every peer on the same steps: steps 1, 10 and 50 of one real AdamW run per model and
LR (FP32 master weights, constant LR 1e-6 and 1e-5, the ``small`` and ``medium`` models; each measured step
is a row set with its ``step``) and the codec benchmark's uniform stress changes (1%, 3%, 5% of a BF16
tensor). Receivers (``receiver``): ``hf``, the same ``transformers`` model in BF16 (a plain module holding
the tensor for stress), whose parameters and ``load_state_dict`` are the engine (:mod:`.engine`); and
``vllm``, a vLLM engine on this machine's CPU for the AdamW steps, where dcr_ray's, SkyRL's and vLLM
``sparse_nccl``'s receivers are timed until it serves the new version (:mod:`.vllm_receivers`).

Peers, each labelled by the code that ran (``peer_code``):

- ``dcr_default``, ``dcr_plain``, ``dcr_class_order`` (``own``): what ``dcr-ray bench codec`` measures on
  the step, the default being the library's own choice at ``--link-mbps``, the receiver an engine's apply
  into the model's parameters (:mod:`.dcr`);
- ``skyrl``: SkyRL 0.4.0's ``DeltaCheckpointPublisher`` and ``LocalCheckpointStore`` (``own``, an
  optional extra, :mod:`.skyrl_code`), run as its trainer and worker run them (:mod:`.skyrl_peer`), else
  a reimplementation from its source (``reimplemented``, :mod:`.skyrl_reimpl`);
- ``vllm_sparse_nccl`` (``format``): bytes counted from the format, applied by vLLM's own
  ``load_checkpoint_weight_patches`` (:mod:`.sparse_nccl`);
- ``xor_zstd1``, ``xor_zstd3``, ``areal``, ``slime`` (``reimplemented``): :mod:`.xor_zstd` and the compact
  encodings of :mod:`.encodings`, all sent as one message of per-tensor streams (:mod:`.container`,
  :mod:`.message_peers`).

Per peer and case: wire bytes and bytes per changed element beside the case's per-tensor entropy bound
(the codec bench's), sender and receiver process CPU seconds (best of the repeats, every sample kept;
the receiver's until the engine holds the new version), bit-exactness of the engine against the trainer
on integer views, and what the receiver does with a corrupted payload (:mod:`.corrupt`: one flipped byte,
one truncation; refused before any write, wrong bits served, reset and replay, bytes fetched again).
:mod:`.runner` runs it all, :mod:`.report` checks the targets (:mod:`.settings`) and writes the table,
the Markdown and the plot; :mod:`.cli` is the subcommand.

The two compact encodings written here from the peers' descriptions (AReaL-DTE style, slime style) keep
their names importable from ``benchmarks.peers`` (the codec and refit benchmarks count their bytes).
"""

from __future__ import annotations

from benchmarks.peers.cli import add_parser
from benchmarks.peers.encodings import (AREAL_DENSE_FALLBACK, PEERS, SLIME_ZSTD_LEVEL, TENSOR_HEADER_BYTES, apply_all,
                                        areal_apply, areal_encode, encode_all, slime_apply, slime_encode, wire_bytes)

__all__ = [
    "AREAL_DENSE_FALLBACK", "PEERS", "SLIME_ZSTD_LEVEL", "TENSOR_HEADER_BYTES", "add_parser", "apply_all",
    "areal_apply", "areal_encode", "encode_all", "slime_apply", "slime_encode", "wire_bytes",
]
