"""PTX fingerprints (debug info stripped) of scan_topk_kernel (batched tf32 / ieee / fma, f16, single, unaligned D) and the slot server's waiting kernels, compiled for sm_90 without a GPU: a refactor that must not change the code compares them before and after. Usage: python3 ptx_fingerprint.py SRC_DIR (Triton 3.6 and torch importable)."""
import sys, re, hashlib
sys.path.insert(0, sys.argv[1])
sys.path.append("/work/main/.venv/lib/python3.11/site-packages")
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from kalos.engine.gpu.kernels import scan, poll

def sig_for(fn, const, ptr_f32=(), ints=(), i64=()):
    sig, consts = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"; consts[(i,)] = const[name]
        elif name in ints: sig[name] = "i32"
        elif name in i64: sig[name] = "i64"
        elif name in ptr_f32: sig[name] = ptr_f32[name]
        else: sig[name] = "*i64"
    return sig, consts

def compile_one(fn, const, ptrs, ints=(), i64=(), warps=4):
    sig, consts = sig_for(fn, const, ptrs, ints, i64)
    ck = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = re.sub(r"^\s*\.(loc|file)\b.*$", "", ck.asm["ptx"], flags=re.M)
    ptx = re.split(r"^\s*\.section\s*\.debug", ptx, flags=re.M)[0]  # (debug info: source lines, inlined scopes)
    ptx = "\n".join(line for line in ptx.splitlines() if line.strip() and not re.match(r"^\$L__tmp\d+:$", line))
    return hashlib.sha1(ptx.encode()).hexdigest()[:12]

ptrs = {"X": "*fp32", "Qs": "*fp32", "HDRF": "*fp64", "LIVE": "*u8", "NS": "*i32", "TS": "*fp64", "OUT": "*i64"}
for name, c in [("tf32 batch", dict(D=1024, K=8, BLOCK_N=64, BLOCK_D=64, BLOCK_Q=16, HALF=False, FILTER=True, PREC="tf32", WRITE_SCORES=True)),
                ("ieee batch D=100", dict(D=100, K=8, BLOCK_N=64, BLOCK_D=64, BLOCK_Q=16, HALF=False, FILTER=False, PREC="ieee", WRITE_SCORES=False)),
                ("fma batch", dict(D=1024, K=8, BLOCK_N=16, BLOCK_D=64, BLOCK_Q=8, HALF=False, FILTER=True, PREC="fma", WRITE_SCORES=True)),
                ("fma D=40", dict(D=40, K=8, BLOCK_N=16, BLOCK_D=64, BLOCK_Q=4, HALF=False, FILTER=False, PREC="fma", WRITE_SCORES=True)),
                ("single", dict(D=1024, K=8, BLOCK_N=64, BLOCK_D=128, BLOCK_Q=1, HALF=False, FILTER=True, PREC="ieee", WRITE_SCORES=False))]:
    print(name, compile_one(scan.scan_topk_kernel, c, ptrs, ints=("stride_out",)))
ptrs = {"X": "*fp16", "Qs": "*fp32", "HDRF": "*fp64", "LIVE": "*u8", "NS": "*i32", "TS": "*fp64", "OUT": "*i64"}
print("f16 batch", compile_one(scan.scan_topk_kernel, dict(D=1024, K=16, BLOCK_N=64, BLOCK_D=64, BLOCK_Q=16, HALF=True, FILTER=True, PREC="ieee", WRITE_SCORES=True), ptrs, ints=("stride_out",)))
common = dict(W_REQ=0, W_OPK=1, W_NQF=2, W_NSLEN=7, W_NSB=8, REQ_WORDS=16, E_Q=64, E_IDS=128, E_SC=256, NS=128, NSMAX=1024, ON_GPU=True)
pp = {"SEGF": "*fp32", "DQ": "*fp32"}
print("await_request", compile_one(poll.await_request_kernel, {**common, "D": 1024, "BLOCK_DQ": 1024}, pp, ints=("n_slots", "k_limit", "op_recall", "flags_all"), i64=("idle",), warps=1))
print("await_requests", compile_one(poll.await_requests_kernel, {**common, "QB": 64}, pp, ints=("n_slots", "k_limit", "op_recall", "flags_all"), i64=("idle", "window"), warps=1))
