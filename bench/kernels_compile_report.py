"""Compile every Triton kernel config for sm_90a without a GPU and print its resources.

Triton's own ptxas (shipped in the triton wheel) assembles the PTX, so shared memory, registers, spills, and
whether the loads became cp.async copies and the dots wgmma can be read here, before spending device time
(docs/KERNELS.md, "Method"). Its nvdisasm shows the machine code: the wgmma shapes (``HGMMA.64xNx16``: a small N
is bound by shared-memory reads, not the tensor cores) and how many spill instructions sit inside a loop (a spill
outside the loops costs once per program). The kernels, their launch shapes and the compile itself come from
``kernels.hopper_compile`` (which the CPU tests run too). Usage: python bench/kernels_compile_report.py [--json FILE] (the lines also as JSON, with command,
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

import triton

from kernels.hopper_compile import KernelSpec, compile_for_hopper, specs

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def tool(name: str, source: str, suffix: str, *flags: str) -> subprocess.CompletedProcess:
    """Run one of the wheel's CUDA tools on ``source`` (PTX text or cubin bytes) written to a temporary file."""
    with tempfile.NamedTemporaryFile("wb", suffix=suffix) as f:
        f.write(source.encode() if isinstance(source, str) else source)
        f.flush()
        return subprocess.run([os.path.join(BIN, name), *flags, f.name], capture_output=True, text=True)


def spill_counts(cubin: bytes) -> dict:
    """Spill instructions (STL/LDL) of a compiled kernel: in all, inside any loop (a backward branch's range of the
    disassembly), and between the wgmma (HGMMA) instructions of a partition; and the wgmma shapes."""
    lines = tool("nvdisasm", cubin, ".cubin", "-c").stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\(\.(L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    spills = [i for i, line in enumerate(lines) if re.search(r"\b(STL|LDL)\b", line)]
    # Warp-specialized code is one region per partition, each entered through a register reallocation; a region's
    # MMA span runs from its first to its last wgmma (its main loop).
    cuts = [0] + [i for i, line in enumerate(lines) if "USETMAXREG" in line] + [len(lines)]
    spans = []
    for a, b in zip(cuts, cuts[1:]):
        mma = [i for i in range(a, b) if "HGMMA" in lines[i]]
        spans += [(mma[0], mma[-1])] if mma else []
    return {"all": len(spills), "in_loops": sum(any(a <= i <= b for a, b in loops) for i in spills),
            "in_mma_spans": sum(any(a <= i <= b for a, b in spans) for i in spills),
            "hgmma": sorted(set(re.findall(r"HGMMA\.(\d+x\d+x\d+)", "\n".join(lines))))}


def machine_code(cubin: bytes) -> str:
    """wgmma shapes and spill instructions (inside loops / in all) of a compiled kernel."""
    n = spill_counts(cubin)
    return (f"HGMMA {','.join(n['hgmma']) or '-'} | spill instrs in loops {n['in_loops']} of {n['all']}, "
            f"among wgmma {n['in_mma_spans']}")


LINES: list[str] = []  # every printed line, for --json


def report(spec: KernelSpec):
    """Compile each autotune config of ``spec`` and print one line of its resources."""
    for config in spec.kernel.configs:
        label = f"{spec.kernel.fn.__name__} {config.kwargs} warps={config.num_warps} stages={config.num_stages}" + (
            f" maxnreg={config.maxnreg}" if config.maxnreg else "")
        try:
            kernel = compile_for_hopper(spec, config)
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
    for spec in specs():
        report(spec)
    if out:
        with open(out, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, no GPU",
                       "date": datetime.datetime.now().isoformat(timespec="seconds"), "triton": triton.__version__,
                       "target": "sm_90a", "lines": LINES}, f, indent=1)


if __name__ == "__main__":
    main()
