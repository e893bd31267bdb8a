"""Compiles every kalos.server.minilm_kernels kernel at every bucket's shape for sm_90 with Triton 3.6, without a GPU (ptx length, shared memory bytes). Usage: /tmp/t36/bin/python compile_check.py SRC_DIR (a venv with triton==3.6.0 and numpy)."""
import sys, re, hashlib
sys.path.insert(0, sys.argv[1])
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from kalos.server import minilm_kernels as mk

def compile_one(fn, const, types, warps=4):
    sig, consts = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"; consts[(i,)] = const[name]
        else:
            sig[name] = types.get(name, "*fp32")
    ck = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return len(ck.asm["ptx"]), ck.metadata.shared

ints = {"n_rows": "i32", "tokens": "i32", "M": "i32", "N": "i32", "K": "i32", "eps": "fp32", "scale": "fp32", "inputs_ptr": "*i64"}
print("embeddings", compile_one(mk._embeddings_kernel, dict(HIDDEN=384, BLOCK_H=512), ints))
print("layernorm", compile_one(mk._layernorm_kernel, dict(HIDDEN=384, BLOCK_H=512), ints))
for m, n, k in [(16, 1152, 384), (16, 384, 1536), (16, 1536, 384), (512, 1152, 384), (8192, 384, 1536)]:
    bm, bn, bk = mk._linear_blocks(m, n)
    for gelu, res in [(False, False), (True, False), (False, True)]:
        print("linear", m, n, k, gelu, res, compile_one(mk._linear_kernel, dict(GELU=gelu, RESIDUAL=res, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), ints))
for t in (16, 32, 64, 128, 256):
    bt = max(16, t); bq = min(bt, 64)
    print("attention", t, compile_one(mk._attention_kernel, dict(HIDDEN=384, HEAD_DIM=32, BLOCK_Q=bq, BLOCK_T=bt), ints, warps=8 if bq * bt >= 8192 else 4))
    print("pool", t, compile_one(mk._mean_pool_kernel, dict(NORMALISE=True, HIDDEN=384, BLOCK_H=512, BLOCK_T=16), ints))
