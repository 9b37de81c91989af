"""Regenerate the golden wire fixtures of the frame format.

    .venv/bin/python tests/golden/make_golden.py

writes ``cases.json`` (every input bit, every encoder setting, and what each case must contain) and
one ``<case>.<i>.bin`` per frame next to this file. ``tests/test_codec_golden.py`` re-encodes the
inputs and expects byte-identical frames, so run this only for a *deliberate* format change (bump
``FORMAT_VERSION`` when old readers cannot read the new frames) and commit the new fixtures with it.

Inputs come from SHAKE-128 of fixed strings, never from a library RNG whose stream could change.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import sys
from pathlib import Path

import msgpack
import numpy as np
import torch
import zstandard

from dcr_ray.codec import FORMAT_VERSION, FrameMeta, diff_tensor, encode_frames
from dcr_ray.codec.bits import bits_view, dtype_of
from dcr_ray.codec.encoding.packdiff import diff_pack

HERE = Path(__file__).resolve().parent
CASES_JSON = HERE / "cases.json"
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


# --- deterministic inputs ---------------------------------------------------------------------------
def pseudo_bits(seed: str, n: int, dtype: torch.dtype) -> np.ndarray:
    """``n`` pseudo-random bit patterns for ``dtype`` (bool: 0/1), reproducible forever."""
    w = torch.empty((), dtype=dtype).element_size()
    raw = np.frombuffer(hashlib.shake_128(seed.encode()).digest(n * w), dtype=np.dtype(_UINT[w]).newbyteorder("<"))
    raw = raw.astype(_UINT[w])
    return raw & 1 if dtype is torch.bool else raw


def pseudo_positions(seed: str, n: int, count: int) -> np.ndarray:
    """``count`` distinct sorted positions below ``n``."""
    keys = np.frombuffer(hashlib.shake_128(seed.encode()).digest(8 * n), dtype="<u8")
    return np.sort(np.argsort(keys, kind="stable")[:count])


def _tensor(bits: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    w = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.ascontiguousarray(bits, _UINT[w]).view(_INT[w]).copy()).view(dtype).reshape(shape)


def _pair(name, dtype, shape, change):
    """(name, old, new): old bits from the name, new = ``change(old bits copy)``."""
    n = int(np.prod(shape))
    old = pseudo_bits(f"old:{name}", n, dtype)
    new = change(old.copy())
    return name, _tensor(old, dtype, shape), _tensor(new, dtype, shape)


def _flip_low(seed, count, mask=0x3):
    def change(b):
        pos = pseudo_positions(seed, len(b), count)
        b[pos] ^= b.dtype.type(mask)
        return b
    return change


def _at(positions, mask):
    def change(b):
        b[positions] ^= b.dtype.type(mask)
        return b
    return change


def _bf16_rows(b):
    rows = b.reshape(32, 32)
    rows[[3, 17]] ^= np.uint16(0x1)  # two embedding rows change together
    return rows.reshape(-1)


def _fp16_dense(b):
    b[:128] = 0x3C00  # the first chunk becomes all 1.0: changed everywhere, and compressible
    b[[130, 200, 255]] ^= np.uint16(0x8000)  # sign flips in the second chunk
    return b


def _bool_flips(seed, count):
    def change(b):
        b[pseudo_positions(seed, len(b), count)] ^= np.uint8(1)
        return b
    return change


def _small_steps(seed, every, shift, cap):
    """An optimizer-like step: a quarter of the elements whose exponent field (bits ``shift`` up) is below
    ``cap`` move by one unit in the last place (up or down, by the seed); every ``every``-th moves too."""
    def change(b):
        t = b.dtype.type
        exp = (b >> t(shift)) & t(0xFF if shift != 10 else 0x1F)
        sign = pseudo_bits(f"sign:{seed}", len(b), torch.uint8) & 1
        coin = pseudo_bits(f"coin:{seed}", len(b), torch.uint8) & 3
        moved = ((exp < cap) & (coin == 0)) | (np.arange(len(b)) % every == 0)
        step = np.where(sign == 1, t(1), np.array(-1).astype(b.dtype))  # -1 wraps: one ulp down
        b[moved] += step[moved]  # unsigned: wraps, across mantissa carries into the exponent
        return b
    return change


def _class_block(shift, cls):
    """Every element whose exponent field is ``cls`` moves up by one unit in the last place."""
    def change(b):
        t = b.dtype.type
        b[((b >> t(shift)) & t(0xFF)) == cls] += t(1)
        return b
    return change


def build_inputs(name: str):
    """The (name, old, new) tensors of golden case ``name``."""
    if name == "bf16_xor_gaps":
        return [_pair("model.layers.0.mlp.down_proj.weight", torch.bfloat16, (32, 64), _flip_low("g1", 40))]
    if name == "bf16_runs":
        return [_pair("model.embed_tokens.weight", torch.bfloat16, (32, 32), _bf16_rows)]
    if name == "fp16_dense_chunk":
        return [_pair("model.norm.weight", torch.float16, (256,), _fp16_dense)]
    if name == "fp32_overwrite":
        return [_pair("lm_head.bias", torch.float32, (600,), _at([0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 500], 0x100))]
    if name == "keyed_multi_dtype":
        return [
            _pair("q.int8", torch.int8, (50,), _flip_low("k1", 5, 0x81)),
            _pair("q.fp8_e4m3", torch.float8_e4m3fn, (40,), _flip_low("k2", 4, 0x1)),
            _pair("q.fp8_e5m2", torch.float8_e5m2, (33,), _flip_low("k3", 33, 0x80)),
            _pair("q.int64", torch.int64, (2, 5), _flip_low("k4", 2, 1 << 63)),
            _pair("q.float64", torch.float64, (12,), _flip_low("k5", 3, 1)),
            _pair("q.uint8", torch.uint8, (7,), _flip_low("k6", 1, 0xFF)),
            _pair("q.int16", torch.int16, (9,), _flip_low("k7", 2, 0x7FFF)),
            _pair("q.int32", torch.int32, (3, 3), _flip_low("k8", 4, 0x1)),
        ]
    if name == "bf16_add_class_gaps":
        return [_pair("model.layers.1.self_attn.o_proj.weight", torch.bfloat16, (64, 64),
                      _small_steps("a1", 97, 7, 100))]
    if name == "fp32_add_class_runs":
        return [_pair("model.layers.1.mlp.up_proj.weight", torch.float32, (40, 50), _class_block(23, 128))]
    if name == "context_multi_dtype":
        return [
            _pair("c.int16", torch.int16, (300,), _small_steps("c1", 7, 15, 0)),
            _pair("c.fp16", torch.float16, (500,), _small_steps("c2", 53, 10, 12)),
            _pair("c.bool", torch.bool, (64,), _bool_flips("c3", 9)),
            _pair("c.bf16_sign", torch.bfloat16, (200,), _at([3, 50, 51, 120], 0x8000)),
        ]
    if name == "bf16_pack_xor":
        return [_pair(f"model.layers.0.mlp.experts.{e}.{proj}.weight", torch.bfloat16, (8, 16),
                      _flip_low(f"p{e}{proj}", 1 + (e * 7 + len(proj)) % 5))
                for e in range(4) for proj in ("gate_proj", "up_proj", "down_proj")]
    if name == "pack_overwrite_two_dtypes":
        return [_pair("experts.0.w", torch.float32, (4, 8), _flip_low("o1", 3, 0x100)),
                _pair("experts.0.scale", torch.int8, (5,), _flip_low("o2", 2, 0x81)),
                _pair("experts.1.w", torch.float32, (4, 8), _flip_low("o3", 1, 0x1))]
    if name == "bool_masks":
        return [_pair("attn.mask", torch.bool, (300,), _bool_flips("b1", 12)),
                _pair("attn.mask_ow", torch.bool, (10, 10), _bool_flips("b2", 5))]
    raise KeyError(name)


#: name -> encoder settings and what the frames must contain (each entry matches at least one item)
CASE_SETTINGS = {
    "bf16_xor_gaps": dict(description="sparse BF16 low-mantissa flips: XOR masks, gap-coded locations",
                          chunk_elems=1024, mode="mixed", must_contain=[{"e": "xor", "lm": "gaps"}]),
    "bf16_runs": dict(description="two whole BF16 embedding rows: XOR masks, run-coded locations",
                      chunk_elems=1024, mode="mixed", must_contain=[{"e": "xor", "lm": "runs"}]),
    "fp16_dense_chunk": dict(description="an FP16 chunk changed everywhere (dense, zstd), one with 3 sign flips",
                             chunk_elems=128, mode="mixed", must_contain=[{"e": "dense"}, {"e": "xor"}],
                             must_have_codec="zstd"),
    "fp32_overwrite": dict(description="FP32 retry frame: absolute new bits, a far change coded as an escape",
                           chunk_elems=600, mode="overwrite", must_contain=[{"e": "ow", "lm": "gaps", "le": 1}]),
    "keyed_multi_dtype": dict(description="keyed frames over eight dtypes, small buckets: several payload ids",
                              chunk_elems=16, mode="mixed", key="golden-transfer-key", bucket_bytes=40,
                              meta=dict(transfer="golden-keyed", attempt=2, producer="owner-3", payload=5, base=11,
                                        target=12),
                              must_contain=[{"e": "xor", "dt": "float8_e4m3fn"}, {"e": "dense", "dt": "float8_e5m2"}]),
    "bool_masks": dict(description="bool tensors: XOR flips and (xor_ok=False) overwrite values",
                       chunk_elems=512, mode="mixed", xor_ok={"attn.mask_ow": False},
                       must_contain=[{"e": "xor", "dt": "bool"}, {"e": "ow", "dt": "bool"}]),
    # context coding (the default since ADD and the class modes): the cases above pin coding="plain"
    "bf16_add_class_gaps": dict(description="BF16 one-ulp steps where the exponent is small (and every 97th "
                                            "element): zigzagged differences, gaps in class order",
                                chunk_elems=4096, mode="mixed", coding="context",
                                must_contain=[{"e": "add", "lm": "cgaps"}]),
    "fp32_add_class_runs": dict(description="FP32: every element of one exponent class moves one ulp up: "
                                            "differences, one run in class order",
                                chunk_elems=2000, mode="mixed", coding="context",
                                must_contain=[{"e": "add", "lm": "cruns"}]),
    "context_multi_dtype": dict(description="context coding across dtypes: int16 differences at flat "
                                            "positions, FP16 class order, bool and sign flips as XOR",
                                chunk_elems=512, mode="mixed", coding="context",
                                must_contain=[{"e": "add", "dt": "int16", "lm": "gaps"}, {"e": "add", "dt": "float16"},
                                              {"e": "xor", "dt": "bool"}, {"e": "xor", "dt": "bfloat16"}]),
    # packs of whole small tensors (dcr_ray.codec.packed): one header entry and a names table per dtype
    "bf16_pack_xor": dict(description="twelve small BF16 expert tensors in one pack: XOR masks at pack positions",
                          chunk_elems=4096, mode="mixed", packs=True, must_contain=[{"e": "xor", "k": 12}]),
    "pack_overwrite_two_dtypes": dict(description="retry frame of packs of two dtypes: absolute new bits",
                                      chunk_elems=4096, mode="overwrite", packs=True,
                                      must_contain=[{"e": "ow", "dt": "float32", "k": 2},
                                                    {"e": "ow", "dt": "int8", "k": 1}]),
}
DEFAULT_META = dict(transfer="golden", attempt=0, producer="owner-0", payload=0, base=1, target=2)


# --- encoding (shared with the test) ------------------------------------------------------------------
def encode_case(case: dict, tensors: list[tuple[str, torch.Tensor, torch.Tensor]]) -> list[bytes]:
    """The frames of ``case`` (a ``cases.json`` entry) for (name, old, new) ``tensors``."""
    if case.get("packs"):  # one pack per dtype, in order of first appearance
        groups: dict = {}
        for name, old, new in tensors:
            groups.setdefault(new.dtype, []).append((name, old, new))
        deltas = [diff_pack([n for n, _, _ in g], [tuple(w.shape) for _, _, w in g],
                            [bits_view(o).copy() for _, o, _ in g], [w for _, _, w in g]) for g in groups.values()]
    else:
        deltas = [diff_tensor(name, bits_view(old).copy(), new, chunk_elems=case["chunk_elems"])
                  for name, old, new in tensors]
    key = case["key"].encode() if case.get("key") else None
    return list(encode_frames(deltas, FrameMeta(**case["meta"]), mode=case["mode"], bucket_bytes=case["bucket_bytes"],
                              zstd_level=case["zstd_level"], key=key, xor_ok=case.get("xor_ok"),
                              coding=case.get("coding", "plain")))


def tensors_of(case: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, old, new) tensors recorded in a ``cases.json`` entry."""
    out = []
    for t in case["tensors"]:
        dt = dtype_of(t["dtype"])
        w = torch.empty((), dtype=dt).element_size()
        old = np.frombuffer(base64.b64decode(t["old_bits"]), dtype=np.dtype(_UINT[w]).newbyteorder("<"))
        new = np.frombuffer(base64.b64decode(t["new_bits"]), dtype=np.dtype(_UINT[w]).newbyteorder("<"))
        out.append((t["name"], _tensor(old, dt, t["shape"]), _tensor(new, dt, t["shape"])))
    return out


def header_of(frame: bytes) -> dict:
    _, _, hlen = struct.unpack_from("<4sBI", frame, 0)
    return msgpack.unpackb(frame[9:9 + hlen], raw=False)


def check_coverage(case: dict, frames: list[bytes]) -> None:
    """Raise AssertionError unless ``frames`` contain what ``case`` says they must."""
    items = [it for f in frames for h in [header_of(f)] for it in h["items"] + h.get("packs", [])]
    for want in case["must_contain"]:
        assert any(all(it.get(k) == v for k, v in want.items()) for it in items), f"{case['name']}: no item {want}"
    if case.get("must_have_codec"):
        codecs = {s[1] for f in frames for s in header_of(f)["sections"]}
        assert case["must_have_codec"] in codecs, f"{case['name']}: no {case['must_have_codec']} section"
    if case.get("bucket_bytes", 1 << 30) < 64:
        assert len(frames) > 1, f"{case['name']}: expected several frames"


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(bits_view(t).astype(bits_view(t).dtype.newbyteorder("<")).tobytes()).decode()


def main() -> int:
    cases = []
    for name, settings in CASE_SETTINGS.items():
        case = {"name": name, "description": settings["description"], "chunk_elems": settings["chunk_elems"],
                "mode": settings["mode"], "coding": settings.get("coding", "plain"), "bucket_bytes": settings.get("bucket_bytes", 64 << 20), "zstd_level": 1,
                "key": settings.get("key"), "xor_ok": settings.get("xor_ok"),
                "meta": settings.get("meta", DEFAULT_META), "must_contain": settings["must_contain"],
                "must_have_codec": settings.get("must_have_codec")}
        if settings.get("packs"):
            case["packs"] = True
        tensors = build_inputs(name)
        case["tensors"] = [{"name": n, "dtype": str(o.dtype).removeprefix("torch."), "shape": list(o.shape),
                            "old_bits": _b64(o), "new_bits": _b64(w)} for n, o, w in tensors]
        frames = encode_case(case, tensors_of(case))
        check_coverage(case, frames)
        case["frames"] = []
        for i, f in enumerate(frames):
            fname = f"{name}.{i}.bin"
            (HERE / fname).write_bytes(f)
            case["frames"].append(fname)
        cases.append(case)
    for stale in HERE.glob("*.bin"):
        if stale.name not in {f for c in cases for f in c["frames"]}:
            stale.unlink()
    doc = {"format_version": FORMAT_VERSION,
           "zstd_version": ".".join(map(str, zstandard.ZSTD_VERSION)),
           "regenerate": "python tests/golden/make_golden.py",
           "bits": "base64 of each tensor's little-endian element bits, flat (row-major)",
           "cases": cases}
    CASES_JSON.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(cases)} cases, {sum(len(c['frames']) for c in cases)} frames to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
