"""Every Triton and Gluon kernel compiles for Hopper, checked on a machine without a GPU.

The interpreter tests (tests/kernels/test_kernels.py) run the kernels' arithmetic but never Triton's compiler; a kernel
that only the compiler rejects passed all of them and stopped every GPU training step (2026-11-30). The Gluon
kernels (the forward, the backward's dKV step, the indexer's scoring) cannot run under the interpreter at all, so
what CI can hold them to is here: they compile, and they keep the resources their designs rest on. The compiles run
in a fresh process because tests/kernels/test_kernels.py turns on ``TRITON_INTERPRET`` for this whole process.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SM90_SHARED_BYTES = 227 * 1024  # the most one CTA may use on an H100/H200 SM

# The Gluon kernels (module, kernel name) at the small model's shapes, compiled in one process (one start-up of
# Triton and torch for the four): each one's shared memory and spill instructions, as JSON by module.
GLUON_KERNELS = {"gluon_attention": "_fwd_kernel", "gluon_dkv": "_bwd_dkv_kernel", "gluon_dq": "_bwd_dq_kernel",
                 "gluon_index_score": "_score_kernel"}
GLUON_RESOURCES = """
import importlib, json, sys
from bench.kernels_compile_report import spill_counts
from kernels import hopper_compile
resources = {}
for module, name in json.loads(sys.argv[1]).items():
    kernel = getattr(importlib.import_module(f"kernels.{module}"), name)
    spec = next(s for s in hopper_compile.specs() if s.kernel is kernel)
    compiled = hopper_compile.compile_for_hopper(spec, spec.kernel.configs[0])
    resources[module] = {"shared": compiled.metadata.shared, "spills": spill_counts(compiled.asm["cubin"])}
print(json.dumps(resources))
"""

def run_compiler(*args: str) -> str:
    """stdout of ``python args`` from the repository root, with the interpreter off; fails the test on an error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def gluon_resources() -> dict:
    return json.loads(run_compiler("-c", GLUON_RESOURCES, json.dumps(GLUON_KERNELS)))


def test_every_kernel_compiles_for_sm90():
    assert "kernel launches compile for sm_90a" in run_compiler("-m", "kernels.hopper_compile")


def test_gluon_forward_fits_one_sm_without_spills(gluon_resources):
    """q and two KV buffers must fit one SM's shared memory, and a consumer's O half (128 registers a thread) leaves
    little room: a spill among its wgmma would slow every block silently. (ptxas reports ~200 bytes, none among the
    wgmma: values the worker warps keep across their register reallocation, some per token in the consumers' token
    loop, and the producer's; with the descriptors hoisted out of the pair loop, i.e. without ``opaque_zero``, 73
    spill instructions fall among the wgmma.)"""
    assert_fits_without_mma_spills(gluon_resources["gluon_attention"])


def test_gluon_dkv_fits_one_sm_without_spills(gluon_resources):
    """q, dO, one 64-row buffer, dS and the staging tiles (consumer 0's also carry P^T over to consumer 1) must fit
    one SM (225 KiB of the 227 KiB an SM grants a block), and no spill may fall among a consumer's wgmma. (With each
    q / dO tile's descriptor made once instead of at its use, i.e. ``_tile`` without its opaque zero, 147 spill
    instructions, 27 of them among the consumers' wgmma.)"""
    assert_fits_without_mma_spills(gluon_resources["gluon_dkv"])


def test_gluon_dq_fits_one_sm_without_spills(gluon_resources):
    """Three ring stages of a 64-row block and its dS tile (216 KiB at D = 512) must fit one SM, and a consumer's dq
    half (128 registers a thread) leaves little room: a spill among its wgmma would slow every block (ptxas reports
    none)."""
    assert_fits_without_mma_spills(gluon_resources["gluon_dq"])


def test_gluon_index_score_fits_one_sm_without_spills(gluon_resources):
    """q (64 KiB) and six 16 KiB key buffers must fit one SM, and each of the four consumers holds S [64, 128] fp32
    (64 registers a thread) of 112: a spill among its wgmma would slow every tile (ptxas reports 4 spill
    instructions, none among the wgmma)."""
    assert_fits_without_mma_spills(gluon_resources["gluon_index_score"])


def assert_fits_without_mma_spills(resources: dict):
    assert resources["shared"] <= SM90_SHARED_BYTES, resources
    assert resources["spills"]["in_mma_spans"] == 0, resources


QUANT_RESOURCES = """
import json
from bench.kernels_compile_report import spill_counts
from kernels import hopper_compile, triton_quant_gemm
resources = []
for spec in hopper_compile.specs():
    if spec.kernel.fn is triton_quant_gemm._quant_gemm_kernel:
        config = spec.kernel.configs[0]
        compiled = hopper_compile.compile_for_hopper(spec, config)
        resources.append({"constexprs": spec.constexprs, "maxnreg": config.maxnreg, "warps": config.num_warps,
                          "shared": compiled.metadata.shared, "spills": spill_counts(compiled.asm["cubin"])})
print(json.dumps(resources))
"""


def test_quant_gemm_holds_two_programs_an_sm_without_spills():
    """``kernels/triton_quant_gemm.py``'s launch shapes rest on two programs an SM (one decodes while the other's wgmma
    runs): each capped at 128 registers a thread over 8 warps (half the register file), with at most half an SM's
    shared memory (less the 1 KiB the SM keeps a block), and no spill anywhere (ptxas reports none at the launch
    shapes; at a width with a partial last step, e.g. 1000, it spills in that step, outside the loop)."""
    resources = json.loads(run_compiler("-c", QUANT_RESOURCES))
    assert len(resources) == 8  # FP8 and FP4, forward and backward, PLAIN and GROUPED tiles
    for r in resources:
        assert r["maxnreg"] * r["warps"] * 32 <= 65536 // 2, r
        assert r["shared"] <= (228 * 1024) // 2 - 1024, r
        assert r["spills"]["all"] == 0, r
