"""The numba definitions behind :mod:`~dcr_ray.codec.compiled.ptrkernels` (imported on first use). At module
level, like :mod:`~dcr_ray.codec.compiled.kernels_numba`, so that numba's on-disk cache finds them again in the
next process.
"""

from __future__ import annotations

import numba
from numba import types
from numba.extending import intrinsic


@intrinsic
def as_pointer(typingctx, addr, like):
    """``addr`` (int64) as a pointer to elements of ``like``'s dtype."""
    sig = types.CPointer(like.dtype)(addr, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


jit = numba.njit(nogil=True, cache=True, boundscheck=False)


@jit
def walk(addrs, offsets, pos, vals, op):  # pragma: no cover - compiled
    # one pass over the sorted pack positions; op 0: ^=, 1: +=, 2: =, 3: read into vals
    t = 0
    for i in range(len(pos)):
        p = pos[i]
        while p >= offsets[t + 1]:
            t += 1
        a = numba.carray(as_pointer(addrs[t], vals), offsets[t + 1] - offsets[t])
        j = p - offsets[t]
        if op == 0:
            a[j] ^= vals[i]
        elif op == 1:
            a[j] += vals[i]
        elif op == 2:
            a[j] = vals[i]
        else:
            vals[i] = a[j]


@jit
def walk_swap(addrs, offsets, pos, vals, old, op):  # pragma: no cover - compiled
    # walk's writes (op 0: ^=, 1: +=, 2: =), each keeping the bits it replaces in old (one pass)
    t = 0
    for i in range(len(pos)):
        p = pos[i]
        while p >= offsets[t + 1]:
            t += 1
        a = numba.carray(as_pointer(addrs[t], old), offsets[t + 1] - offsets[t])
        j = p - offsets[t]
        o = a[j]
        old[i] = o
        if op == 0:
            a[j] = o ^ vals[i]
        elif op == 1:
            a[j] = o + vals[i]
        else:
            a[j] = vals[i]


@jit
def scan(old_addrs, new_addrs, offsets, t0, pos, xor, new):  # pragma: no cover - compiled
    # whole tensors from t0 on while the outputs can hold all of the next one: (next tensor, written)
    n = 0
    t = t0
    cap = len(pos)
    while t < len(offsets) - 1:
        size = offsets[t + 1] - offsets[t]
        if n + size > cap:
            break
        o = numba.carray(as_pointer(old_addrs[t], xor), size)
        w = numba.carray(as_pointer(new_addrs[t], xor), size)
        base = offsets[t]
        for j in range(size):
            if o[j] != w[j]:
                pos[n] = base + j
                xor[n] = o[j] ^ w[j]
                new[n] = w[j]
                n += 1
        t += 1
    return t, n
