"""A decode kernel (SFA's or Focus's) compiled for an H200 (sm_90) without a GPU: its shared memory, registers and
the instructions of each loop of its SASS, to count before a device call (METHOD.md: count, predict, then measure).

Compiles ``_sfa_decode_chunk`` of ``sieve_attn.ops.sfa.MODULE`` (``--kernel sfa``, 5 pipeline stages, one warp) or
``_focus_decode_chunk`` of ``sieve_attn.ops.focus.MODULE`` (``--kernel focus``, the stages and warps its launch
uses) with the specialisation of the launch at 128K cached tokens, GQA 32/8, D = 128, bfloat16, one query (integer
arguments equal to 1 become constants, multiples of 16 get divisibility 16, as Triton's launcher does). Use the
Triton of the device image for figures that hold there: ``pip install --no-deps --target /tmp/triton36
triton==3.6.0``, then
    PYTHONPATH=/tmp/triton36:. python benchmarks/decode_sass.py --kernel sfa --topk 16
(not under TRITON_INTERPRET). Prints the shared memory, the registers, and per backward branch (a loop) its
instruction count and most frequent opcodes.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sieve_attn.ops.sfa.pool import unit_levels

HEAD_DIM, ROWS, KEYS_PER_TILE, CACHED, KV_HEADS, GROUP = 128, 4, 32, 131072, 8, 4


def launch_values(topk: int, packed: int) -> dict:
    """The integer arguments of the 128K launch (the H200 plan: 132 chunks of 27 tiles)."""
    head_bytes = -(-CACHED * packed // 4) * 4
    return dict(stride_qb=GROUP * KV_HEADS * HEAD_DIM, stride_qh=HEAD_DIM, stride_qt=HEAD_DIM, stride_qd=1,
                stride_ib=KV_HEADS * head_bytes, stride_ih=head_bytes, stride_kb=KV_HEADS * CACHED * topk // 4,
                stride_kh=CACHED * topk // 4, stride_kt=topk // 4, stride_vb=KV_HEADS * CACHED * HEAD_DIM,
                stride_vh=CACHED * HEAD_DIM, stride_vt=HEAD_DIM, stride_vd=1, kv_heads=KV_HEADS, group=GROUP,
                q_len=1, k_len=CACHED, chunk_keys=27 * KEYS_PER_TILE, num_chunks=132)


def compile_sfa(module, topk: int):
    kernel = module._sfa_decode_chunk
    packed = (topk * 7 + 7) // 8
    constants = dict(HEAD_DIM=HEAD_DIM, TOPK=topk, INDEX_BITS=7, NBYTES=packed, BLOCK_M=ROWS,
                     BLOCK_N=KEYS_PER_TILE, PER_WORD=4, VALUE_DTYPE=tl.bfloat16, NATIVE_DOT=True, V_TMA=True,
                     UNIT_LEVELS=unit_levels(module._UNIT_TILES), UNIT_KEYS=module._UNIT_TILES * KEYS_PER_TILE,
                     PREFETCH_TILES=module._PREFETCH_TILES)
    pointers = dict(Q="*bf16", TABLE="*bf16", COUNTERS="*i32", IDX="*u8", VAL="*i64", V="*bf16", O="*fp32",
                    LSE="*fp32", V_DESC=f"tensordesc<bf16[1, 1, {KEYS_PER_TILE}, {HEAD_DIM}]>", scale="fp32")
    return compile_launch(kernel, constants, pointers, launch_values(topk, packed), num_warps=1, num_stages=5)


def compile_focus(module):
    """The Focus decode kernel of the 128K launch: the H200 plan's 98 chunks of 21 64-key tiles, no softcap."""
    kernel = module._focus_decode_chunk
    block_n = module._block_n(HEAD_DIM)
    constants = dict(HEAD_DIM=HEAD_DIM, BLOCK_M=ROWS, BLOCK_N=block_n, SCAN_N=module._SCAN_N, SCAN_M=1,
                     SCAN_STAGES=module._SCAN_STAGES, PREFETCH_KEYS=module._PREFETCH_KEYS, SOFTCAP=False,
                     NATIVE_DOT=True)
    pointers = dict(Q="*bf16", K="*bf16", V="*bf16", BITS="*i64", KEYS="*i32", O="*fp32", LSE="*fp32",
                    scale="fp32", softcap="fp32")
    head = CACHED * HEAD_DIM
    values = dict(stride_qb=GROUP * KV_HEADS * HEAD_DIM, stride_qh=HEAD_DIM, stride_qt=HEAD_DIM, stride_qd=1,
                  stride_kb=KV_HEADS * head, stride_kh=head, stride_kt=HEAD_DIM, stride_kd=1,
                  stride_vb=KV_HEADS * head, stride_vh=head, stride_vt=HEAD_DIM, stride_vd=1,
                  stride_bits_b=CACHED, stride_bits_t=1, kv_heads=KV_HEADS, group=GROUP, q_len=1, k_len=CACHED,
                  window=128, chunk_keys=21 * block_n, num_chunks=98)
    return compile_launch(kernel, constants, pointers, values, num_warps=module._NUM_WARPS,
                          num_stages=module._num_stages(HEAD_DIM, 2))


def compile_launch(kernel, constants: dict, pointers: dict, values: dict, *, num_warps: int, num_stages: int):
    """``kernel`` compiled for sm_90 as Triton's launcher specialises it for these integer ``values`` (constants
    it does not take are dropped: a module's earlier version may take others)."""
    constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants or values.get(name) == 1:
            signature[name] = "constexpr"
            constants.setdefault(name, values.get(name))
            continue
        signature[name] = pointers.get(name, "i32")
        if signature[name].startswith("*") or values.get(name, 1) % 16 == 0:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def loops(sass: str):
    """(first address, last address, instructions, opcode counts) of each backward branch's range."""
    instructions = [(int(m.group(1), 16), m.group(2).strip())
                    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s*(.*?);", sass)]
    where = {address: i for i, (address, _) in enumerate(instructions)}
    for i, (address, text) in enumerate(instructions):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in where:
            body = instructions[where[int(target.group(1), 16)]:i + 1]
            opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
            yield body[0][0], address, len(body), opcodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("sfa", "focus"), default="sfa")
    parser.add_argument("--module", default="decode", help="sieve_attn.ops.KERNEL.MODULE (default: decode)")
    parser.add_argument("--topk", type=int, default=16, help="SFA's top-k (--kernel sfa)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("TRITON_INTERPRET is set: the interpreter compiles nothing; unset it")
    module = importlib.import_module(f"sieve_attn.ops.{args.kernel}.{args.module}")
    compiled = compile_sfa(module, args.topk) if args.kernel == "sfa" else compile_focus(module)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool("cuobjdump"), "-res-usage", cubin.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin.name], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    what = f"topk {args.topk}" if args.kernel == "sfa" else "focus"
    print(f"triton {triton.__version__}, {what}: shared {compiled.metadata.shared} bytes, "
          f"registers {registers.group(1) if registers else '?'}")
    for first, last, count, opcodes in loops(sass):
        print(f"loop {first:#x}-{last:#x}: {count} instructions; " +
              ", ".join(f"{name} {n}" for name, n in opcodes.most_common(12)))


if __name__ == "__main__":
    main()
