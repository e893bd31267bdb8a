"""The error bounds that make the reduced-precision scans exact, and the 8-bit rows' quantiser.

Exactness of ``precision="fast"``
---------------------------------
Let ``x``, ``q`` be the float32 row and query, ``x~``, ``q~`` their 16-bit roundings,
``u`` the unit roundoff of the 16-bit format (2^-11 for float16), ``eta`` its subnormal
absolute error (2^-25 for float16, ~0 for bfloat16), ``a = |x|``, ``b = |q|``. The products
``x~_i q~_i`` are exact in float32, so the 16-bit score ``s~`` (float32 accumulation, any
order, tensor cores allowed: we charge ``2^-22`` per addition instead of ``2^-24`` to cover
their truncating accumulation) and the float32 re-score ``s`` (same ``gamma_D(2^-24)``
bound as any float32 dot product) satisfy

    |s~ - s| <= E = (2u + u^2) ab + eta (1+u) sqrt(D) (a+b) + eta^2 D
                    + gamma_D(2^-22) [(1+u)^2 ab + eta (1+u) sqrt(D) (a+b) + eta^2 D]
                    + gamma_D(2^-24) ab,        gamma_D(v) = D v / (1 - D v),

inflated by 1% (:func:`fast_error_terms`). ``a`` is the largest row norm ever written
(float64), ``b`` is computed per query in the kernel. Let ``t_k`` be the k-th best 16-bit
score among eligible rows. Any row with ``s~ < t_k - 2E`` has ``s < t_k - E <= s_j`` for the
k rows ``j`` at or above ``t_k``, so it cannot be in the float32 top-k. The pipeline keeps
the exact top-``KF`` by 16-bit score (``KF`` = 4x the k bucket, at least 32); if the
``KF``-th kept score is below ``t_k - 2E`` (or fewer than ``KF`` rows are eligible), every
possible member of the float32 top-k is among the kept rows, which are re-scored in float32
and the top k of those returned: the same answer as a float32 scan (ties aside). Otherwise
the query's status is set and the host re-runs it with the exact float32 scan. For random
unit vectors at D = 1024, E is about 1.3e-3 and the fallback essentially never fires;
clusters of near-duplicates can make it fire, and it then costs one exact scan.

A single query (``single_chunk_rescore``, up to ``chunk_rescore_max_rows`` rows) certifies
chunk by chunk instead: each chunk of scores keeps its top ``R`` by 16-bit score (``R`` =
2x the k bucket, at least 32), re-scores them in float32 and passes on its best ``kp`` float32
keys; a row the chunk left out has ``s~ <= t_R`` (the chunk's R-th kept 16-bit score), so
``s <= t_R + E``. With ``B`` the largest ``t_R + E`` over the chunks that left rows out
(rounded up to a float32), if the k-th best float32 score among the kept rows beats ``B``, no
row left out can enter the top k: the same answer again. Rows a chunk re-scored but did not
pass on had ``kp >= k`` better ones in that chunk. The final kernel then selects among float32
keys only (scores_rescore_kernel, final_kernel's CHUNK_CERT).

A single query in fast mode (``single_scan="int8"``, the default with the Triton backend)
scans an 8-bit copy instead, with the same chunk certificate and a wider E. A row is stored as
``x8 = scale8 * c`` (``c`` int8, ``scale8 = max|x| / 127``) with residual ``e = x - x8``;
``r`` is the largest ``|e|`` of any row written (float64; it never shrinks). The kernel
splits the query into two int8 planes against ``s_q = max|q| / 127``:
``q8 = s_q (hi + lo/256)``, ``|q - q8| <= eps_q |q|`` with ``eps_q = sqrt(D) / (127 * 256)``
(+ float32 rounding of ``q / s_q``). The products are summed in int32, exactly; the float32
steps after them (two conversions, one add, two scalings) cost ``16 * 2^-24`` of
``|q8| |x8|``. As ``q.x - q8.x8 = q8.e + (q - q8).x``,

    |s8 - s32| <= E = [eps_q + gamma_D(2^-24) + 16 * 2^-24 (1 + eps_q)] ab
                      + (1 + eps_q + 16 * 2^-24 (1 + eps_q)) r b,

inflated by 1% (:func:`int8_error_terms`; the ``r`` term travels in the header's ``row_err8``
word, so adds after a graph's capture are covered). For random unit vectors at D = 1024, ``r`` is
about 0.013 and E about 0.014: ten times the 16-bit bound, still far below the gap between
a chunk's 32nd score and the k-th best of 65,536 rows. The ``r b`` term is what a query along
a row's rounding error needs (``test_int8_error_bound_holds``).

The same certificate serves the tf32 scan of the float32 rows for exact batches
(``Tuning.exact_batch_scan = "tf32"``, the default; "ieee" keeps the FMA scan; u = 2^-10
covers tf32 truncation), which moves exact batches from the FMA units to the tensor cores
without a second copy of the rows.
"""
from __future__ import annotations

import math

import torch

from kalos.errors import InvalidArgument

__all__ = ["fast_error_terms", "int8_error_terms", "quantize_rows"]


def fast_error_terms(dim: int, half: str = "float16") -> tuple[float, float, float]:
    """``(A, B, C)`` with ``|s16 - s32| <= A*|x|*|q| + B*(|x| + |q|) + C`` for one dot product
    whose operands were rounded to ``half`` ("float16", "bfloat16" or "tf32").

    See the module docstring for the derivation; 1% is added for the float64 evaluation.
    """
    if half == "float16":
        u, eta = 2.0**-11, 2.0**-25
    elif half == "bfloat16":
        u, eta = 2.0**-8, 2.0**-134
    elif half == "tf32":  # 10 stored mantissa bits; 2^-10 covers truncation as well as rounding
        u, eta = 2.0**-10, 2.0**-134
    else:
        raise InvalidArgument(f"unknown reduced format {half!r}: use float16, bfloat16 or tf32")

    def gamma(v: float) -> float:
        nv = dim * v
        if nv >= 0.5:
            raise InvalidArgument(f"dimension {dim} too large for the 16-bit error bound")
        return nv / (1.0 - nv)

    g_acc, g32 = gamma(2.0**-22), gamma(2.0**-24)
    root = math.sqrt(dim)
    a = (2 * u + u * u) + g_acc * (1 + u) ** 2 + g32
    b = eta * (1 + u) * root * (1 + g_acc)
    c = eta * eta * dim * (1 + g_acc)
    return a * 1.01, b * 1.01, c * 1.01 + 1e-12


def int8_error_terms(dim: int) -> tuple[float, float]:
    """``(A, R)`` with ``|s8 - s32| <= A*|x|*|q| + R*r*|q|`` for the 8-bit score of a row
    (``int8_scores_kernel``) against its float32 re-score, ``r`` the largest ``|x - x8 *
    scale8|`` of a row written (float64). See the module docstring; 1% is added."""
    g32 = dim * 2.0**-24 / (1.0 - dim * 2.0**-24)
    eps_q = math.sqrt(dim) / (127 * 256) * (1 + 2.0**-23) + 2.0**-22  # the query's two planes
    rounding = 16 * 2.0**-24 * (1 + eps_q)  # the kernel's float32 steps after the exact sums
    return (eps_q + g32 + rounding) * 1.01, (1 + eps_q + rounding) * 1.01


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """float32 rows as (int8 codes, float32 scales, the largest residual norm, float64):
    ``x ~ scale * codes``, ``scale = max|x| / 127`` per row (1 for a zero row)."""
    amax = x.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    resid = torch.linalg.vector_norm(x.double() - codes.double() * scale.double()[:, None], dim=1)
    return codes, scale, float(resid.max()) if len(resid) else 0.0
