"""Every Triton and Gluon kernel of the package compiled for Hopper (sm_90a) on a machine without a GPU.

The CPU tests run the kernels through Triton's interpreter, which executes their arithmetic but not the compiler
(and cannot run Gluon at all), so a kernel can pass all of them and still fail to compile on the GPU (2026-11-30: a
``tl.constexpr`` name bound inside ``static_range`` stopped every 64K training step). ``specs()`` gives each kernel
the argument types and constexprs of a real launch at the ``small`` model's shapes; ``compile_for_hopper`` runs
Triton's compiler with the ptxas shipped in the triton wheel. ``python -m kernels.hopper_compile`` compiles the
first config of each and exits 1 naming those that fail (a CPU test runs it); ``bench/kernels_compile_report.py``
compiles every autotune config and reads their resources. Both need ``TRITON_INTERPRET`` unset: under the
interpreter a kernel is not compilable.
"""
import sys
from types import SimpleNamespace
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from kernels import gluon_attention as gluon_attn
from kernels import gluon_dkv
from kernels import gluon_dq
from kernels import gluon_index_score
from kernels import triton_attention as attn
from kernels import triton_cast as cast
from kernels import triton_dkv as dkv
from kernels import triton_hyper as hyper
from kernels import triton_indexer as idx
from kernels import triton_moe as moe
from kernels import triton_norm as nrm
from kernels import triton_quant_gemm as qgemm
from kernels import triton_rope as rope
from kernels import triton_select as sel
from kernels import triton_swiglu as swiglu
from kernels.triton_common import INTERPRET

HOPPER = GPUTarget("cuda", 90, 32)


class KernelSpec(NamedTuple):
    kernel: object  # an autotuner, or ``untuned(...)``: ``.fn`` (the @triton.jit function) and ``.configs``
    types: dict  # runtime arguments -> Triton type strings; every other argument is a constexpr
    constexprs: dict


def untuned(kernel, num_warps: int, num_stages: int = 1, maxnreg: int | None = None):
    """A plain @triton.jit kernel with the one launch config its host code uses, shaped like an autotuner."""
    return SimpleNamespace(fn=kernel, configs=[triton.Config({}, num_warps=num_warps, num_stages=num_stages,
                                                             maxnreg=maxnreg)])


def compile_for_hopper(spec: KernelSpec, config: triton.Config):
    """Compile one config; pointer and integer arguments (and those inside tuples) marked 16-divisible, as the JIT
    marks them at the real shapes (without that mark Triton vectorizes no load and pipelines nothing)."""
    fn = spec.kernel.fn
    signature = {name: spec.types.get(name, "constexpr") for name in fn.arg_names}
    aligned = {}
    for name, t in spec.types.items():
        i = fn.arg_names.index(name)
        for path, element in [((i,), t)] if isinstance(t, str) else [((i, j), e) for j, e in enumerate(t)]:
            if element[0] in "*i":
                aligned[path] = [["tt.divisibility", 16]]
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages,
                   **({"maxnreg": config.maxnreg} if config.maxnreg else {}))
    source = GluonASTSource if fn.is_gluon() else ASTSource
    constexprs = {**spec.constexprs, **config.kwargs, **({"num_warps": config.num_warps} if fn.is_gluon() else {})}
    return triton.compile(source(fn, signature, constexprs, aligned), target=HOPPER, options=options)


def dkv_descriptors(H: int, D: int, slots: int) -> dict:
    """Type strings of the Gluon dKV step's TMA descriptors (their block shapes and layouts), from descriptors over
    stand-in CPU tensors (a descriptor's type carries no address)."""
    q, dout, part, ds = (torch.empty(shape, dtype=torch.bfloat16) for shape in ((1, H, D), (1, H, D), (1, slots, D),
                                                                               (1, H, slots)))
    return dict(zip(("q_desc", "do_desc", "part_desc", "ds_desc"),
                    map(mangle_type, gluon_dkv.descriptors(q, dout, part, ds))))


def forward_q_descriptor(D: int) -> dict:
    """Type string of the Gluon forward's q descriptor at feature dimension D, as ``dkv_descriptors``."""
    return dict(q_desc=mangle_type(gluon_attn.q_descriptor(torch.empty((1, 64, D), dtype=torch.bfloat16))))


def dq_descriptor(H: int, slots: int) -> dict:
    """Type string of the Gluon dq kernel's dS descriptor, as ``dkv_descriptors``."""
    return dict(ds_desc=mangle_type(gluon_dq.ds_descriptor(torch.empty((1, H, slots), dtype=torch.bfloat16))))


def index_score_descriptors(NH: int, DI: int) -> dict:
    """Type strings of the Gluon scoring kernel's TMA descriptors (q rows and keys), as ``dkv_descriptors``."""
    q, k = torch.empty((1, NH, DI), dtype=torch.bfloat16), torch.empty((1, DI), dtype=torch.bfloat16)
    return dict(zip(("q_desc", "key_desc"), map(mangle_type, gluon_index_score.descriptors(q, k))))


def specs() -> list[KernelSpec]:
    """Each kernel at the launch shapes of the ``small`` model (H=64, d=512, top-512, window 128, 128-dim indexer), and
    the Gluon kernels also at other shapes they accept (``usable`` of ``gluon_attention``, ``gluon_dkv`` and
    ``gluon_index_score``: no GPU test runs them)."""
    if INTERPRET:
        raise RuntimeError("kernels.hopper_compile needs TRITON_INTERPRET unset: interpreted kernels do not compile")
    bf, f32, i64, i32 = "*bf16", "*fp32", "*i64", "i32"
    shape = dict(D=512, W=128, K=512, BLOCK_H=64, ROPE=64)
    rows = dict(KV=bf, WIN_LO=i64, IDX=i64, comp_offset="i64", T=i32, S=i32, H=i32)
    chunk = dict(W=128, K=512, D=512)
    index = dict(NH=i32)
    levels = dict(row_len=i32, level1=i32)
    select = dict(LEVELS=f32, VIS_LO=i64, VIS_HI=i64, SCRATCH=i64, OUT=i64, row_len=i32, width0=i32, top=i32)
    norm = dict(X=bf, W=f32, ROT=f32, R=i32, H=i32, x_stride=i32)
    logits = dict(Q=bf, WGT=bf, KEY=bf, IDX=i64, T=i32, S=i32, **index)
    fwd_common = dict(SINK=f32, ROT=f32, OUT=bf, LSE=f32, MASS=f32, STAGE="*fp16", stage_head_stride=i32,
                      scale_log2="fp32", **rows)
    fwd_types = dict(fwd_common, Q=bf, stage_token_stride=i32)
    # the Gluon forward: q by TMA (forward_q_descriptor), a stage per program, persistent over B*T tokens
    gluon_fwd_types = dict(fwd_common, stage_program_stride=i32, n_tokens=i32)
    dq_types = dict(ROT=f32, DQ=bf, tok0=i32, n_tokens=i32, **rows)
    dkv_types = dict(DOUT=bf, OUT=bf, SINK=f32, ROT=f32, LSE=f32, DSINK=f32, tok0=i32, scale="fp32", n_tokens=i32,
                     **rows)
    out = [
        KernelSpec(attn._fwd_kernel, fwd_types, dict(K_P=attn._padded_k(512), MASS_PASS=True, **shape)),
        KernelSpec(gluon_attn._fwd_kernel, gluon_fwd_types | forward_q_descriptor(512),
                   dict(K_P=attn._padded_k(512), MASS_PASS=True, SKIP=0, **shape)),
        KernelSpec(attn._bwd_dkv_kernel, dict(Q=bf, DOUT=bf, OUT=bf, SINK=f32, ROT=f32, SCRATCH=bf, LSE=f32, PART=bf,
                                              DS=bf, DSINK=f32, tok0=i32, scale="fp32", **rows), shape),
        KernelSpec(gluon_dkv._bwd_dkv_kernel, dict(dkv_types, **dkv_descriptors(64, 512, 128 + 512)),
                   dict(D=512, W=128, K=512, ROPE=64, SKIP=0)),
        KernelSpec(attn._bwd_dq_kernel, dict(DS=bf, ROT=f32, DQ=bf, tok0=i32, **rows), shape),
        KernelSpec(dkv._window_reduce_kernel, dict(PART=bf, DKV=f32, tok0=i32, n_tok=i32, row0=i32, n_rows=i32), chunk),
        KernelSpec(dkv._entry_reduce_kernel, dict(PART=bf, ORDER=i64, OFFSETS=i64, DKV=f32), chunk),
        KernelSpec(idx._score_kernel, dict(Q=bf, WGT=bf, KEY=bf, VIS_LO=i64, VIS_HI=i64, LEVELS=f32, n_queries=i32,
                                           width_class=i32, **levels, **index),
                   dict(DI=128, NH_P=32, G=8, SPLIT=idx.SCORE_SPLIT, WHILE_LOOP=False)),
        KernelSpec(idx._cand_score_kernel, dict(Q=bf, WGT=bf, KEY=bf, VIS_LO=i64, VIS_HI=i64, CAND=i64, LEVELS=f32,
                                                **levels, **index), dict(DI=128, NH_P=32, G=8, NC=2048)),
        KernelSpec(sel._select_kernel, select, dict(K=512, K_P=512, G=8, LOG_G=3)),
        KernelSpec(untuned(sel._group_max_kernel, num_warps=4),
                   dict(LEVELS=f32, VIS_LO=i64, VIS_HI=i64, row_len=i32, src=i32, dst=i32, dst_width=i32, level=i32),
                   dict(G=8, LOG_G=3, BLOCK=256)),
        KernelSpec(idx._logits_fwd_kernel, dict(OUT=f32, **logits), dict(DI=128, NH_P=32, K=512)),
        KernelSpec(idx._logits_bwd_kernel, dict(DOUT=f32, DQ=bf, DW=bf, DKEY=f32, **logits),
                   dict(DI=128, NH_P=32, K=512)),
    ]
    # a layer's weights: w1 with w3 stacked (one leading index), w2 alone; then the routed experts' w1/w3 stacks
    # stacked expert by expert (24 x 448 rows each, dim 1024) and w2; each forward and backward
    for shapes in (((4096, 1024), (4096, 1024)), ((1024, 4096),)), (((24, 448, 1024), (24, 448, 1024)),
                                                                      ((24, 1024, 448),)):
        layout, _ = cast._layout([[torch.Size(shape) for shape in group] for group in shapes])
        for split in (False, True):
            out.append(KernelSpec(untuned(cast._cast_kernel, num_warps=4),
                                  dict(SRC=(f32,) * len(layout["CHUNK"]), OUT=(bf,) * len(shapes)),
                                  dict(**layout, BLOCK=cast.BLOCK, SPLIT=split)))
    # the recomputation's forward (no selected mass) at the small model's shapes
    out.append(KernelSpec(gluon_attn._fwd_kernel, gluon_fwd_types | forward_q_descriptor(512),
                          dict(K_P=attn._padded_k(512), MASS_PASS=False, SKIP=0, **shape)))
    for D, W, K, rope_dim in ((128, 32, 100, 32), (64, 16, 0, 0)):  # K not a power of two; window only, no RoPE
        out.append(KernelSpec(gluon_attn._fwd_kernel, gluon_fwd_types | forward_q_descriptor(D),
                              dict(D=D, W=W, K=K, K_P=attn._padded_k(K), BLOCK_H=64, ROPE=rope_dim, MASS_PASS=K > 0,
                                   SKIP=0)))
    for D, W, K, rope_dim in ((512, 128, 512, 64), (128, 40, 96, 32), (64, 16, 0, 0)):
        out.append(KernelSpec(gluon_dq._bwd_dq_kernel, dict(dq_types, **dq_descriptor(64, W + K)),
                              dict(D=D, W=W, K=K, ROPE=rope_dim)))
    for D, W, K, rope_dim in ((128, 40, 96, 32), (64, 16, 0, 0)):  # W not a multiple of 32; window only, no RoPE
        out.append(KernelSpec(gluon_dkv._bwd_dkv_kernel, dict(dkv_types, **dkv_descriptors(64, D, W + K)),
                              dict(D=D, W=W, K=K, ROPE=rope_dim, SKIP=0)))
    # the small model's indexer (32 x 128, blocks of 8; first: the compile test reads it), then other index heads,
    # head dimension and block size the Gluon scoring kernel accepts
    for NH, DI, G in ((32, 128, 8), (64, 64, 4), (16, 128, 64)):
        out.append(KernelSpec(gluon_index_score._score_kernel,
                              dict(WGT=bf, VIS_LO=i64, VIS_HI=i64, LEVELS=f32, n_queries=i32, **levels,
                                   **index_score_descriptors(NH, DI)), dict(NH=NH, DI=DI, G=G, SPLIT=idx.SCORE_SPLIT)))
    for D, rope_dim in ((768, 0), (512, 64)):  # q_norm; kv_norm + the window-KV rotation
        block_d, block_r, warps = nrm._launch_shape(D)
        norm_shape = dict(D=D, BLOCK_D=block_d, ROPE=rope_dim, BLOCK_R=block_r)
        out.append(KernelSpec(untuned(nrm._rms_norm_fwd, num_warps=warps), dict(OUT=bf, RSTD=f32, eps="fp32", **norm),
                              norm_shape))
        out.append(KernelSpec(untuned(nrm._rms_norm_bwd, num_warps=warps),
                              dict(DOUT=bf, RSTD=f32, DX=bf, DW_PART=f32, **norm), norm_shape))
    for I, limit, weighted in ((4096, 0.0, False), (448, 10.0, True), (2304, 10.0, False)):  # dense, routed, shared
        shape = dict(I=I, LIMIT=limit, WEIGHTED=weighted, ROWS=swiglu.TILE // swiglu.BLOCK, BLOCK=swiglu.BLOCK)
        w = dict(W=f32) if weighted else {}
        out.append(KernelSpec(untuned(swiglu._swiglu_fwd_kernel, num_warps=4), dict(H=bf, OUT=bf, n_rows=i32, **w),
                              shape))
        out.append(KernelSpec(untuned(swiglu._swiglu_bwd_kernel, num_warps=4),
                              dict(H=bf, DOUT=bf, DH=bf, n_rows=i32, **w, **(dict(DW=f32) if weighted else {})), shape))
    for D, K in ((1024, 4), (5120, 6)):  # small_moe's and V4.1's dim and top-k
        shape = dict(D=D, K=K, TOKENS=moe.TILE // moe.BLOCK, BLOCK=moe.BLOCK)
        for spread in (False, True):  # the spread of fp32 tokens into bf16 slots; the sum of bf16 slots into fp32
            for other in (False, True):  # without and with the shared expert's copy / output
                out.append(KernelSpec(untuned(moe._token_rows_kernel, num_warps=4),
                                      dict(ROWS=bf, SLOT=i64, TOKEN_ROWS=f32, n_tokens=i32, **(dict(OTHER=bf) if other
                                                                                              else {})),
                                      dict(shape, SPREAD=spread, WITH_OTHER=other)))
    for D in (1024, 5120):  # the hyper-connected stream (hc 4, a bf16 stream) of small_moe and V4.1
        stream = dict(D=D, HC=4, BLOCK_D=hyper.TOKEN_BLOCK_D)
        projection = dict(stream, BLOCK_D=hyper.BLOCK_D, MIX=24, MIX_P=32, BLOCK_N=hyper.BLOCK_N)
        sinkhorn = dict(HC=4, HC_P=4, MIX=24, STEPS=39, ROWS=hyper.SINKHORN_ROWS)
        out.append(KernelSpec(untuned(hyper._pre_fwd, num_warps=hyper.WARPS),
                              dict(X=bf, PRE_IN=f32, FN=bf, H=bf, MPART=f32, SQPART=f32, n_rows=i32),
                              dict(projection, SPLIT_BLOCKS=D // hyper.BLOCK_D // hyper.PRE_SPLITS, SPLIT_FN=True)))
        out.append(KernelSpec(untuned(hyper._pre_bwd, num_warps=hyper.BWD_WARPS),
                              dict(X=bf, PRE_IN=f32, FN=f32, DH=bf, DMRAW=f32, COEF=f32, STASH=bf, DX=bf, DFN=f32,
                                   DPRE=f32, n_rows=i32, tiles_per_split=i32),
                              dict(projection, BLOCK_N=hyper.BWD_BLOCK_N, BLOCK_D=hyper.BWD_BLOCK_D, HAS_STASH=True,
                                   WHILE_LOOP=False)))
        expand = dict(stream, HC_P=4, BLOCK_T=hyper.EXPAND_TOKENS)
        out.append(KernelSpec(untuned(hyper._expand_fwd, num_warps=hyper.EXPAND_WARPS),
                              dict(X=bf, Y=bf, POST=f32, COMB=f32, OUT=bf, n_rows=i32), expand))
        out.append(KernelSpec(untuned(hyper._expand_bwd, num_warps=hyper.EXPAND_WARPS),
                              dict(X=bf, Y=bf, POST=f32, COMB=f32, G=bf, DX=bf, DY=bf, DPOST=f32, DCOMB=f32,
                                   n_rows=i32), expand))
        out.append(KernelSpec(untuned(hyper._collapse_fwd, num_warps=4), dict(X=bf, PRE=f32, OUT=bf),
                              dict(stream, HC_P=4)))
        out.append(KernelSpec(untuned(hyper._collapse_bwd, num_warps=4), dict(X=bf, PRE=f32, G=bf, DX=bf, DPRE=f32),
                              dict(stream, HC_P=4)))
    out.append(KernelSpec(untuned(hyper._sinkhorn_fwd, num_warps=4),
                          dict(MPART=f32, SQPART=f32, SCALE=f32, BASE=f32, MRAW=f32, RSTD=f32, PRE=f32, POST=f32,
                               COMB=f32, n_rows=i32, norm_eps="fp32", hc_eps="fp32"),
                          dict(sinkhorn, D=5120, SPLITS=hyper.PRE_SPLITS)))
    out.append(KernelSpec(untuned(hyper._sinkhorn_bwd, num_warps=4),
                          dict(MRAW=f32, RSTD=f32, SCALE=f32, BASE=f32, DPRE=f32, DPOST=f32, DCOMB=f32, SCRATCH=f32,
                               DMRAW=f32, COEF=f32, PARTS=f32, n_rows=i32, hc_eps="fp32"), dict(sinkhorn, D=1024)))
    # the frozen base kept as released (issue 56): FP8 32 x 32 blocks (a linear, Q = dim) and FP4 per-32 experts
    # (Q = dim forward, the expert width backward to x), each forward and backward to x, in both launch shapes
    # (PLAIN: matrices of many rows, one linear or wo_a's groups; GROUPED: a stack of experts)
    quant = dict(X=bf, CODES="*u8", SCALE="*u8", OUT=bf, TILE_EXPERT="*i32", TILE_ROW=i64, TILE_END=i64, N=i32,
                 K=i32, P=i32, code_stride=i32, scale_rows=i32, scale_cols=i32)
    for tiles in (qgemm.PLAIN, qgemm.GROUPED):
        for (R, C, fp4), width in (((32, 32, False), 1024), ((1, 32, True), 448)):
            for transpose in (False, True):
                out.append(KernelSpec(untuned(qgemm._quant_gemm_kernel, tiles.warps, tiles.stages, tiles.maxnreg),
                                      quant, dict(Q=width if transpose else 1024, R=R, C=C, FP4=fp4,
                                                  TRANSPOSE=transpose, PRECISION="tf32", BM=tiles.BM, BP=tiles.BP,
                                                  BQ=tiles.BQ)))
    for R, C, fp4 in ((32, 32, False), (1, 32, True)):  # the transient dequantised stack of many rows a matrix
        out.append(KernelSpec(untuned(qgemm._dequant_kernel, qgemm.DEQUANT_WARPS),
                              dict(CODES="*u8", SCALE="*u8", OUT=bf, N=i32, K=i32, code_stride=i32, scale_rows=i32,
                                   scale_cols=i32, out_stride=i32),
                              dict(TN=qgemm.DEQUANT_TILE[0], TK=qgemm.DEQUANT_TILE[1], R=R, C=C, FP4=fp4,
                                   MASK_N=False, MASK_K=False)))
    for conj in (False, True):  # forward rotation; its transpose in the backward
        out.append(KernelSpec(rope._rope_kernel, dict(x=bf, rotation=f32, out=bf, R=i32, H=i32),
                              dict(D=512, DIM=64, BLOCK_REST=512, CONJ=conj)))
    return out


def main() -> int:
    launches, failed = specs(), []
    for spec in launches:
        try:
            compile_for_hopper(spec, spec.kernel.configs[0])
        except Exception as e:  # noqa: BLE001 - every kernel is tried; the list of failures is the result
            failed.append(f"{spec.kernel.fn.__name__}: {type(e).__name__}: {e}")
    print("\n".join(failed) or f"all {len(launches)} kernel launches compile for sm_90a")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
