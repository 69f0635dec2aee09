"""Compile every Triton kernel config for sm_90a without a GPU and print its resources.

Triton's own ptxas (shipped in the triton wheel) assembles the PTX, so shared memory, registers, spills, and
whether the loads became cp.async copies and the dots wgmma can be read here, before spending device time
(docs/KERNELS.md, "Method"). Its nvdisasm shows the machine code: the wgmma shapes (``HGMMA.64xNx16``: a small N
is bound by shared-memory reads, not the tensor cores) and how many spill instructions sit inside a loop (a spill
outside the loops costs once per program). Pointer and integer arguments are marked 16-divisible, as the JIT marks
them at the real shapes: without that mark Triton vectorizes no load and pipelines nothing, and the report would
mislead. Usage: python bench/kernels_compile_report.py [--json FILE] (the lines also as JSON, with command,
machine and date)
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import triton_attention as attn
from kernels import triton_dkv as dkv
from kernels import triton_indexer as idx
from kernels import triton_norm as nrm
from kernels import triton_select as sel

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
HOPPER = GPUTarget("cuda", 90, 32)


def tool(name: str, source: str, suffix: str, *flags: str) -> subprocess.CompletedProcess:
    """Run one of the wheel's CUDA tools on ``source`` (PTX text or cubin bytes) written to a temporary file."""
    with tempfile.NamedTemporaryFile("wb", suffix=suffix) as f:
        f.write(source.encode() if isinstance(source, str) else source)
        f.flush()
        return subprocess.run([os.path.join(BIN, name), *flags, f.name], capture_output=True, text=True)


def machine_code(cubin: bytes) -> str:
    """wgmma shapes and spill instructions (inside loops / in all) of a compiled kernel."""
    lines = tool("nvdisasm", cubin, ".cubin", "-c").stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\(\.(L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    spills = [i for i, line in enumerate(lines) if re.search(r"\b(STL|LDL)\b", line)]
    in_loops = sum(any(a <= i <= b for a, b in loops) for i in spills)
    shapes = sorted(set(re.findall(r"HGMMA\.(\d+x\d+x\d+)", "\n".join(lines))))
    return f"HGMMA {','.join(shapes) or '-'} | spill instrs in loops {in_loops} of {len(spills)}"


LINES: list[str] = []  # every printed line, for --json


def untuned(kernel, num_warps: int, num_stages: int = 1, maxnreg: int | None = None):
    """A plain @triton.jit kernel with the one launch config its host code uses, shaped like an autotuner."""
    return SimpleNamespace(fn=kernel, configs=[triton.Config({}, num_warps=num_warps, num_stages=num_stages,
                                                             maxnreg=maxnreg)])


def report(autotuned, types: dict, constexprs: dict):
    """Compile each autotune config of ``autotuned`` (args not in ``types`` are constexpr) and print one line."""
    fn = autotuned.fn
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in types.items() if t[0] in "*i"}
    for config in autotuned.configs:
        consts = {**constexprs, **config.kwargs}
        label = f"{fn.__name__} {config.kwargs} warps={config.num_warps} stages={config.num_stages}" + (
            f" maxnreg={config.maxnreg}" if config.maxnreg else "")
        try:
            kernel = triton.compile(ASTSource(fn, signature, consts, aligned), target=HOPPER,
                                    options=dict(num_warps=config.num_warps, num_stages=config.num_stages,
                                                 **({"maxnreg": config.maxnreg} if config.maxnreg else {})))
        except Exception as e:  # noqa: BLE001 - one config failing to compile is itself the finding
            LINES.append(f"{label}: COMPILE FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            print(LINES[-1])
            continue
        ptxas = tool("ptxas", kernel.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", os.devnull).stderr
        usage = " ".join(line.split(":", 1)[-1].strip() for line in ptxas.splitlines() if "Used" in line or "spill" in line)
        ttgir = kernel.asm["ttgir"]
        LINES.append(f"{label}: smem={kernel.metadata.shared} B | {usage} | wgmma={ttgir.count('warp_group_dot ')} "
                     f"mma={ttgir.count('tt.dot ')} cp.async={ttgir.count('async_copy_global_to_local')} | "
                     f"{machine_code(kernel.asm['cubin'])}")
        print(LINES[-1], flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the lines to this JSON file")
    out = parser.parse_args().json
    bf, f32, i64, i32 = "*bf16", "*fp32", "*i64", "i32"
    shape = dict(D=512, W=128, K=512, BLOCK_H=64)
    rows = dict(KV=bf, WIN_LO=i64, IDX=i64, comp_offset="i64", T=i32, S=i32, H=i32)
    report(attn._fwd_kernel, dict(Q=bf, SINK=f32, OUT=bf, LSE=f32, MASS=f32, STAGE="*fp16", stage_token_stride=i32,
                                  stage_head_stride=i32, scale_log2="fp32", **rows),
           dict(K_P=attn._padded_k(512), MASS_PASS=True, **shape))
    report(attn._bwd_dkv_kernel, dict(Q=bf, DOUT=bf, OUT=bf, SINK=f32, LSE=f32, PART=bf, DS=bf, DSINK=f32, tok0=i32,
                                      scale="fp32", **rows), shape)
    report(attn._bwd_dq_kernel, dict(DS=bf, DQ=bf, tok0=i32, **rows), shape)
    chunk = dict(W=128, K=512, D=512)
    report(dkv._window_reduce_kernel, dict(PART=bf, DKV=f32, tok0=i32, n_tok=i32, row0=i32, n_rows=i32), chunk)
    report(dkv._entry_reduce_kernel, dict(PART=bf, ORDER=i64, OFFSETS=i64, DKV=f32), chunk)
    index = dict(NH=i32)
    levels = dict(row_len=i32, level1=i32)
    report(idx._score_kernel, dict(Q=bf, WGT=bf, KEY=bf, VIS_LO=i64, VIS_HI=i64, LEVELS=f32, n_queries=i32, **levels,
                                   **index), dict(DI=128, NH_P=32, G=8, SPLIT=idx.SCORE_SPLIT, WHILE_LOOP=False))
    report(idx._cand_score_kernel, dict(Q=bf, WGT=bf, KEY=bf, VIS_LO=i64, VIS_HI=i64, CAND=i64, LEVELS=f32, **levels,
                                        **index), dict(DI=128, NH_P=32, G=8, NC=2048))
    select = dict(LEVELS=f32, VIS_LO=i64, VIS_HI=i64, SCRATCH=i64, OUT=i64, row_len=i32, width0=i32, top=i32)
    report(untuned(sel._select_kernel, **sel.SELECT_LAUNCH), select, dict(K=512, K_P=512, G=8, LOG_G=3))
    report(untuned(sel._group_max_kernel, num_warps=4), dict(LEVELS=f32, VIS_LO=i64, VIS_HI=i64, row_len=i32, src=i32,
                                                             dst=i32, dst_width=i32, level=i32),
           dict(G=8, LOG_G=3, BLOCK=256))
    norm = dict(X=bf, W=f32, ROT=f32, R=i32, H=i32)
    for D, rope in ((768, 0), (512, 64)):  # q_norm; kv_norm + the window-KV rotation
        block_d, block_r, warps = nrm._launch_shape(D)
        shape = dict(D=D, BLOCK_D=block_d, ROPE=rope, BLOCK_R=block_r)
        report(untuned(nrm._rms_norm_fwd, num_warps=warps), dict(OUT=bf, RSTD=f32, eps="fp32", **norm), shape)
        report(untuned(nrm._rms_norm_bwd, num_warps=warps), dict(DOUT=bf, RSTD=f32, DX=bf, DW_PART=f32, **norm), shape)
    logits = dict(Q=bf, WGT=bf, KEY=bf, IDX=i64, T=i32, S=i32, **index)
    report(idx._logits_fwd_kernel, dict(OUT=f32, **logits), dict(DI=128, NH_P=32, K=512))
    report(idx._logits_bwd_kernel, dict(DOUT=f32, DQ=bf, DW=bf, DKEY=f32, **logits), dict(DI=128, NH_P=32, K=512))
    if out:
        with open(out, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, no GPU",
                       "date": datetime.datetime.now().isoformat(timespec="seconds"), "triton": triton.__version__,
                       "target": "sm_90a", "lines": LINES}, f, indent=1)


if __name__ == "__main__":
    main()
