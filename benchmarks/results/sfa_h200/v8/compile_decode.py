"""Offline sm_90 compile of the SFA decode kernel (triton from PYTHONPATH; v8 counted with triton 3.6), prints registers, spills, shared memory
and SASS instruction counts of the main loop. Usage: python compile_decode.py TOPK [key=value constexpr overrides]"""
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sieve_attn.ops.sfa import decode

topk = int(sys.argv[1]) if len(sys.argv) > 1 else 16
over = dict(a.split("=") for a in sys.argv[2:])
stages = int(over.pop("stages", 3))
fn = decode._sfa_decode_chunk
names = fn.arg_names
ptr = {"Q": "*bf16", "TABLE": "*bf16", "IDX": "*u8", "VAL": "*i64", "V": "*bf16", "V_DESC": "tensordesc<bf16[1,1,32,128]>", "O": "*fp32", "LSE": "*fp32"}
import triton.language as tl
const = dict(HEAD_DIM=128, TOPK=topk, INDEX_BITS=7, NBYTES=(topk * 7 + 7) // 8, BLOCK_M=4, BLOCK_N=32, PER_WORD=4, VALUE_DTYPE=tl.bfloat16,
             NATIVE_DOT=True, V_TMA=0)
for k, v in over.items():
    const[k] = int(v) if v.lstrip("-").isdigit() else v
if not const["V_TMA"]:
    const["V_DESC"] = None
sig = {}
for n in names:
    if n in const:
        sig[n] = "constexpr"
    elif n in ptr:
        sig[n] = ptr[n]
    elif n == "scale":
        sig[n] = "fp32"
    elif n.startswith("stride") and n.endswith(("qd", "vd", "ibyte")):
        sig[n] = "i32"   # unit strides are specialised as 1 by the launcher
        const[n] = 1
        sig[n] = "constexpr"
    else:
        sig[n] = "i32"
# divisibility 16 for pointers and the strides the launcher would see as multiples of 16
div = [i for i, n in enumerate(names) if sig[n].startswith("*") or n in ("stride_vt", "stride_vh", "stride_vb", "stride_qh", "stride_qb", "chunk_keys")]
attrs = {(i,): [["tt.divisibility", 16]] for i in div}
src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, num_stages=stages))
cub = tempfile.mktemp(suffix=".cubin"); open(cub, "wb").write(k.asm["cubin"])
usage = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"), "-res-usage", cub],
                       capture_output=True, text=True).stdout
print("shared", k.metadata.shared, re.search(r"REG:\d+", usage).group(0), re.search(r"STACK:\d+", usage).group(0))
nvd = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
sass = subprocess.run([nvd, "-c", "-g", cub], capture_output=True, text=True).stdout
lines = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", l)]
print("total SASS", len(lines))
open(os.environ.get("SASS_OUT", "/tmp/decode.sass"), "w").write(sass)
from loop_ops import main_loop  # beside this file
loop, ops = main_loop(sass)
print("loop instructions", len(loop), "per key", len(loop) / const["BLOCK_N"])
print(sorted(ops.items(), key=lambda x: -x[1])[:30])
