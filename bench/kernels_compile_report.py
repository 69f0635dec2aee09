"""Compile every Triton kernel config for sm_90a without a GPU and print its resources.

Triton's own ptxas (shipped in the triton wheel) assembles the PTX, so shared memory, registers, spills, and
whether the loads became cp.async copies and the dots wgmma can be read here, before spending device time
(docs/KERNELS.md, "Method"). Pointer and integer arguments are marked 16-divisible, as the JIT marks them at the
real shapes: without that mark Triton vectorizes no load and pipelines nothing, and the report would mislead.
Usage: python bench/kernels_compile_report.py
"""
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import triton_attention as attn
from kernels import triton_dkv as dkv
from kernels import triton_indexer as idx

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
HOPPER = GPUTarget("cuda", 90, 32)


def report(autotuned, types: dict, constexprs: dict):
    """Compile each autotune config of ``autotuned`` (args not in ``types`` are constexpr) and print one line."""
    fn = autotuned.fn
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in types.items() if t[0] in "*i"}
    for config in autotuned.configs:
        consts = {**constexprs, **config.kwargs}
        label = f"{fn.__name__} {config.kwargs} warps={config.num_warps} stages={config.num_stages}"
        try:
            kernel = triton.compile(ASTSource(fn, signature, consts, aligned), target=HOPPER,
                                    options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
        except Exception as e:  # noqa: BLE001 - one config failing to compile is itself the finding
            print(f"{label}: COMPILE FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(kernel.asm["ptx"])
            ptx.flush()
            ptxas = subprocess.run([PTXAS, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull],
                                   capture_output=True, text=True).stderr
        usage = " ".join(line.split(":", 1)[-1].strip() for line in ptxas.splitlines() if "Used" in line or "spill" in line)
        ttgir = kernel.asm["ttgir"]
        print(f"{label}: smem={kernel.metadata.shared} B | {usage} | wgmma={ttgir.count('warp_group_dot ')} "
              f"mma={ttgir.count('tt.dot ')} cp.async={ttgir.count('async_copy_global_to_local')}")


def main():
    bf, f32, i64, i32 = "*bf16", "*fp32", "*i64", "i32"
    report(attn._fwd_kernel, dict(Q=bf, KVW=bf, WIN_LO=i64, KVC=bf, IDX=i64, SINK=f32, OUT=bf, LSE=f32, MASS=f32,
                                  PSCR="*fp16", T=i32, S=i32, H=i32, scale_log2="fp32"),
           dict(D=512, W=128, K=512, K_P=attn._padded_k(512), BLOCK_H=64, MASS_PASS=True))
    report(attn._bwd_kernel, dict(Q=bf, KVW=bf, WIN_LO=i64, KVC=bf, IDX=i64, SINK=f32, OUT=bf, DOUT=bf, LSE=f32, DQ=bf,
                                  PART=bf, DSINK=f32, tok0=i32, T=i32, S=i32, H=i32, scale="fp32"),
           dict(D=512, W=128, K=512, BLOCK_H=64))
    chunk = dict(W=128, K=512, D=512)
    report(dkv._window_reduce_kernel, dict(PART=bf, DKV=f32, tok0=i32, n_tok=i32, row0=i32, n_rows=i32), chunk)
    report(dkv._entry_reduce_kernel, dict(PART=bf, ORDER=i64, OFFSETS=i64, DKV=f32), chunk)
    index = dict(NH=i32)
    report(idx._score_kernel, dict(Q=bf, WGT=bf, KEY=bf, VIS_LO=i64, VIS_HI=i64, OUT=f32, n_queries=i32, s_begin=i32,
                                   s_end=i32, C=i32, **index), dict(DI=128, NH_P=32, WHILE_LOOP=False))
    report(idx._cand_score_kernel, dict(Q=bf, WGT=bf, KEY=bf, VIS_LO=i64, VIS_HI=i64, CAND=i64, OUT=f32, **index),
           dict(DI=128, NH_P=32, BS=8, NC=2048))
    logits = dict(Q=bf, WGT=bf, KEY=bf, IDX=i64, T=i32, S=i32, **index)
    report(idx._logits_fwd_kernel, dict(OUT=f32, **logits), dict(DI=128, NH_P=32, K=512))
    report(idx._logits_bwd_kernel, dict(DOUT=f32, DQ=bf, DW=bf, DKEY=f32, **logits), dict(DI=128, NH_P=32, K=512))


if __name__ == "__main__":
    main()
