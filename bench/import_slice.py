"""Import of a V4.1-width slice in DeepSeek's released format (issue 36, Measure): seconds, bytes read and peak host /
GPU memory of ``train.init_from=<released dir>`` for one pipeline stage of 4 layers on one expert-parallel rank.

    CSA2_CODE=<commit> python bench/import_slice.py --out $OUT/import_slice.json    # one H200
    python bench/import_slice.py --smoke --out /tmp/import_slice.json                # the same code on the CPU,
                                                                                     # v41_slice's smoke widths

One child process per phase, so that each phase's peak host RSS (``VmHWM``) is its own:
- ``write``: layers 20-23 of ``model=v41_flash layout=v41`` (``--layers``; the slice of ``bench/v41_slice.py``: Full
  layer 20, the candidate source with its compressor and indexer, and Reuse 21-23) with all 384 routed experts a
  layer, by the repo's writer (``train.formats.released_format.write_released``: FP8 e4m3 in 32 x 32 e8m0 blocks for the
  attention and shared-expert matrices, FP4 e2m1 with an e8m0 scale per 32 for the routed experts, bf16 / fp32 for
  the rest, shards of 5 GB and the index) and ``config.json`` (``deepseek_config``: the whole 40-layer model's; the
  shards hold the slice's layers only): 29.6 GB in a new directory under ``--dir`` (default $TMPDIR or /tmp),
  removed at the end unless ``--keep``. Values: Normal(0, init_std) drawn on the device from a (seed, name)
  generator and rounded onto the grid they are stored in, so an exact import returns them bit for bit. The files
  are then flushed and dropped from the page cache (fsync, POSIX_FADV_DONTNEED), so the import reads the disk.
- ``import`` (``--warm``: a second time, from the page cache): what the trainer does for a released
  ``train.init_from``: ``released_changes``, ``InitFrom`` (the headers, matched against the whole model on
  the meta device; ``train.init_strict=false``, as the directory holds only the slice's layers), the stage's
  ``Transformer(layer_ids=..., init=False)`` on the device as rank 0 of an E = 16 expert-parallel group
  (``--expert-parallel``, ``--expert-rank``: experts 0-23 of the 384), then ``InitFrom.load_into`` (given the
  stage's model for the engine; a stage of its own has no shadows to sync), which calls ``load_stage``: layer by
  layer, its tensors read by ``safe_open`` slices (the rank's experts only) and dequantised into fp32 on the model's
  device (the host before issue 56), then copied into the model. Timed:
  opening, building, loading; within loading the dequantisation per format, the reading (the rest of
  ``ReleasedWeights.load``) and the copy into the model. Checked: every tensor of the stage was loaded, the bytes
  read are the preflight's share (``rank_share``), and the first and last tensor of each stored form (the first
  held expert of layer 20, the last of layer 23, ...) equal the values written, exactly.
- ``import_quantized``: the same import as a LoRA run over the base held as released does it
  (``train.lora.quantized_base=true``), from the disk again (the page cache dropped once more), in the same call as
  ``import_cold`` so that the two compare: ``InitFrom(..., quantized_base=True)``, the stage built by
  ``model.quantized_build.quantized_transformer`` (the FP8 / FP4 matrices born as empty buffers of codes and scales,
  never in full precision; the rest drawn as the trainer's stage draws it), then ``InitFrom.load_into``:
  ``fill_stored`` copies the stored codes and scales in, undecoded (``ReleasedWeights.load_stored``), and
  ``load_stage`` the plain tensors. The same keys, with nothing dequantised; new keys: ``held_as_stored`` (tensors),
  ``load_stored_calls_s`` (reading them) and ``fill_copy_s`` (copying them into the buffers; the import's
  ``read_s`` and ``copy_into_model_s`` include both kinds of tensor). Checked as ``import``, the first and last tensor
  of each stored form held as stored: its codes and scales the file's bytes (read by ``safe_open``) and decoding to
  the values written. The adapters are not attached: they are drawn, not imported, and the base is held the same
  whichever matrices they adapt.
The slice has no Engram layer (1 and 14 hold the tables): the JSON estimates the import of the released tables
(196.6 B values, 203 GB stored as FP8 rows of 32) at the measured rates (``held_as_stored_s``: at
``import_quantized``'s). Where the disk is too small or slow for 29.6 GB, ``--expert-parallel 1
model.moe.n_routed_experts=24`` writes only the rank's 24 experts (and so measures no selective read).
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train.formats.init_from as init_from  # noqa: E402
import train.formats.released_format as released  # noqa: E402
from model import Transformer, layout_from_config  # noqa: E402
from model.cli import compose, resolved  # noqa: E402
from model.config import ModelArgs, apply  # noqa: E402
from model.deepseek_config import CONFIG, deepseek_config, released_changes  # noqa: E402
from model.engram_layout import table_rows  # noqa: E402
from model.quant import dequantize, quantize, scale_shape  # noqa: E402
from model.quantized_base import QuantizedMatrix, QuantizedTable, Slot, quantized_form, stored_slots  # noqa: E402
from model.quantized_build import quantized_transformer  # noqa: E402
from model.seeding import seeded_generator  # noqa: E402
from model.transformer import init_std  # noqa: E402
from result_meta import result_meta  # noqa: E402
from train.export import parse_size  # noqa: E402
from train.formats.init_from import InitFrom, rank_share  # noqa: E402
from train.formats.reference_format import MAX_SHARD_BYTES, write_json  # noqa: E402
from v41_slice import SMOKE, V41, StandInDispatch, parse_slices  # noqa: E402

GB, GIB = 1e9, 2**30
# (label, the child's phase): import_quantized follows import_cold in the same call, the page cache dropped again
PHASES = (("write", "write"), ("import_cold", "import"), ("import_quantized", "import_quantized"),
          ("import_warm", "import"))


# ------------------------------------------------------------------------------------------------ the slice

def slice_shapes(args: ModelArgs, layout, layers: range) -> dict[str, torch.Size]:
    """Our tensor names and shapes of the stage's layers with every routed expert: what the file holds."""
    with torch.device("meta"):
        return {n: t.shape for n, t in Transformer(args, layout, layer_ids=layers, init=False).state_dict().items()}


def stored_bytes(name: str, shape: torch.Size) -> int:
    """Bytes of codes and scales the release stores for ``name`` (``released.storage``)."""
    form, n = released.storage(name), shape.numel()
    if form.fmt is None:
        return n * form.dtype.itemsize
    scales = scale_shape(shape, form.block)
    return n // (2 if form.fmt == "fp4" else 1) + scales[0] * scales[1]


def written_value(name: str, shape, args: ModelArgs, n_layers: int, seed: int, device) -> torch.Tensor:
    """The value written for ``name``, in fp32: Normal(0, init_std) from its (seed, name) generator on ``device``,
    rounded onto the grid it is stored in (FP8 / FP4 blocks, bf16), so a correct import returns it exactly."""
    value = torch.randn(shape, generator=seeded_generator(seed, name, device), device=device)
    value *= init_std(name, args, n_layers)
    form = released.storage(name)
    if form.fmt is None:
        return value.to(form.dtype).float()
    return dequantize(*quantize(value, form.fmt, form.block), form.fmt, form.block)


class WrittenState(Mapping):
    """The slice's state dict for ``write_released``, each tensor drawn when the writer asks for it: the 4 layers'
    54 B values do not fit in memory at once in fp32 (the writer holds one shard's codes at a time)."""

    def __init__(self, shapes: dict, args: ModelArgs, n_layers: int, seed: int, device):
        self.shapes, self.draw = shapes, lambda name: written_value(name, shapes[name], args, n_layers, seed, device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.draw(name)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def describe(shapes: dict, layers: range, args: ModelArgs, dispatch) -> dict:
    """The slice's shapes (one layer's tensors, one expert's) and value counts by stored form."""
    first, held = layers.start, dispatch.experts_of(args.moe.n_routed_experts)
    values: dict[str, int] = {}
    for name, shape in shapes.items():
        form = released.storage(name)
        kind = form.fmt or str(form.dtype).removeprefix("torch.")
        values[kind] = values.get(kind, 0) + shape.numel()
    per_expert = sum(s.numel() for n, s in shapes.items() if f".ffn.experts.{held.start}." in n)
    return {"layers": list(layers), "routed_experts_in_file": args.moe.n_routed_experts,
            "expert_parallel": dispatch.world, "expert_rank": dispatch.rank, "held_experts": [held[0], held[-1]],
            "tensors_in_file": len(shapes), "values_in_file": sum(values.values()), "values_by_form": values,
            "values_held_by_rank": sum(values.values()) - per_expert * (args.moe.n_routed_experts - len(held)),
            "stored_bytes_in_file": sum(stored_bytes(n, s) for n, s in shapes.items()),
            "shapes": {n: list(s) for n, s in shapes.items() if n.startswith(f"layers.{first}.") and
                       (".ffn.experts." not in n or f".ffn.experts.{held.start}." in n)}}


# ------------------------------------------------------------------------------------------------ measuring

def host_memory() -> dict[str, float]:
    """This process's resident memory now and its peak (GiB), from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[name].split()[0]) * 1024 / GIB for key, name in (("rss", "VmRSS"), ("peak", "VmHWM"))}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gpu_memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    sync(device)
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}


class Stopwatch:
    """Adds up the seconds of ``owner.name`` by ``key(*args)``, and the bytes of its tensor arguments: the attribute
    is wrapped where the importer looks it up, for the rest of the process (a phase's child)."""

    def __init__(self, owner, name: str, key=lambda *args: "all"):
        self.seconds: dict[str, float] = {}
        self.bytes: dict[str, int] = {}
        self.calls: list[float] = []
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            spent, label = time.perf_counter() - start, key(*args)
            self.calls.append(spent)
            self.seconds[label] = self.seconds.get(label, 0.0) + spent
            self.bytes[label] = self.bytes.get(label, 0) + sum(a.numel() * a.element_size() for a in args
                                                               if isinstance(a, torch.Tensor))
            return out

        setattr(owner, name, timed)


# ------------------------------------------------------------------------------------------------ the phases

def write_phase(a, args: ModelArgs, layout, device: torch.device) -> dict:
    directory = Path(a.released)
    shapes = slice_shapes(args, layout, a.layers)
    slice_ = describe(shapes, a.layers, args, StandInDispatch(a.expert_parallel, a.expert_rank))
    free = shutil.disk_usage(directory).free
    if slice_["stored_bytes_in_file"] * 1.01 > free:
        sys.exit(f"error: the slice needs {slice_['stored_bytes_in_file'] / GB:.1f} GB in {directory}, which has "
                 f"{free / GB:.1f} GB free: pass --dir on a larger disk, or write the rank's experts only "
                 "(--expert-parallel 1 model.moe.n_routed_experts=24)")
    start = time.perf_counter()
    state = WrittenState(shapes, args, layout.n_layers, a.seed, device)
    files, report = released.write_released(state, directory, max_shard_bytes=a.max_shard_size)
    write_json(directory / CONFIG, deepseek_config(args, layout))
    written = time.perf_counter()
    drop_page_cache(directory)
    return {"slice": slice_, "write_s": written - start, "flush_s": time.perf_counter() - written,
            "page_cache": "dropped after writing (fsync, POSIX_FADV_DONTNEED; a no-op on some file systems: "
                          "compare import_cold with import_warm, --warm)",
            "files": len(files), "bytes_on_disk": sum(p.stat().st_size for p in directory.iterdir()),
            "quantised_tensors": len(report), "quantised_exact": sum(r["exact"] for r in report.values()),
            "host_gib": host_memory(), "gpu": gpu_memory(device)}


def drop_page_cache(directory: Path) -> None:
    """The released files on disk and out of the page cache (fsync, POSIX_FADV_DONTNEED): the next import reads the
    disk."""
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def import_phase(a, device: torch.device, quantized: bool) -> dict:
    """One import of the slice as ``train.init_from`` does it; ``quantized``: as a LoRA run over the base held as
    released does it (``train.lora.quantized_base``: built without the base's full precision, its codes and scales
    filled as stored), from the disk again (the page cache dropped: the first import read the files into it)."""
    config = resolved(compose([*a.config, f"train.init_from={a.released}", "train.init_strict=false"]))
    torch.zeros(1, device=device)  # the CUDA context, before the clock starts
    if quantized:
        drop_page_cache(Path(a.released))
    host_start = host_memory()
    start = time.perf_counter()
    changes = released_changes(config)  # what the preflight does first
    config = apply(config, changes)
    args, layout = config.model.args, layout_from_config(config.layout)
    init = InitFrom(config.train.init_from, config.train.init_strict, args, layout, quantized)
    opened = time.perf_counter()
    dispatch = StandInDispatch(a.expert_parallel, a.expert_rank)
    with torch.device(device):  # as parallel/stage.py builds it (the quantized build draws what is not the base)
        model = quantized_transformer(quantized_form, args, layout, a.layers, experts=dispatch) if quantized else \
            Transformer(args, layout, layer_ids=a.layers, init=False, experts=dispatch)
    sync(device)
    built = time.perf_counter()
    host_built = host_memory()
    source, loaded = init.source, set(init.match.loaded)
    loads, stored_loads = Stopwatch(source, "load"), Stopwatch(source, "load_stored")
    fills = Stopwatch(init_from, "fill_stored")
    dequantisations = Stopwatch(released, "dequantize", key=stored_form)
    init.load_into(SimpleNamespace(module=SimpleNamespace(stage=SimpleNamespace(model=model)),
                                   sync_shadows=lambda: None))  # the engine's parts it uses: a stage has no shadows
    gpu = gpu_memory(device)
    done = time.perf_counter()

    state, slots = model.state_dict(), stored_slots(model)
    plain = {name: t for name, t in state.items() if name not in held_buffers(model)}
    share = rank_share(source.shapes(), args, a.layers, False, False, a.expert_rank, a.expert_parallel, 0, 1)
    predicted = sum(source.stored_bytes(n, r) for n, r in share.items() if n in loaded)
    exact = {name: torch.equal(plain[name], written_value(name, plain[name].shape, args, layout.n_layers, a.seed,
                                                          device)) for name in first_and_last(plain)}
    exact |= {name: stored_exact(name, slots[name], source, args, layout.n_layers, a.seed)
              for name in first_and_last(slots)}
    check = {"every_tensor_loaded": set(plain) | set(slots) <= loaded,
             "bytes_read_equal_the_share": source.bytes_read == predicted, "exact": exact}
    check["ok"] = check["every_tensor_loaded"] and check["bytes_read_equal_the_share"] and all(exact.values())
    load_s, stored_s, dequant_s = sum(loads.calls), sum(stored_loads.calls), sum(dequantisations.seconds.values())
    return {"open_s": opened - start, "build_s": built - opened, "load_s": done - built, "total_s": done - start,
            "load_calls_s": loads.calls, "dequantise_s": dequantisations.seconds,
            "dequantise_stored_bytes": dequantisations.bytes, "read_s": load_s + stored_s - dequant_s,
            "copy_into_model_s": done - built - load_s - stored_s,
            "quantized_base": quantized, "held_as_stored": len(slots), "load_stored_calls_s": stored_loads.calls,
            "fill_copy_s": sum(fills.calls) - stored_s,
            "bytes_read": source.bytes_read, "bytes_predicted": predicted,
            "bytes_in_files": sum((Path(a.released) / f).stat().st_size for f in set(source.weight_map.values())),
            "stored_gb_per_s": source.bytes_read / (done - built) / GB,
            "values_loaded": sum(t.numel() for t in plain.values()) + sum(slot_values(s) for s in slots.values()),
            "host_threads": torch.get_num_threads(),
            "config_changed": [f"{key} -> {value!r}" for key, value in changes.items()],
            "tensors_matched": len(init.match.loaded), "check": check,
            "host_gib": {"start": host_start["rss"], "after_build": host_built["rss"], **host_memory()},
            "gpu": gpu, "model_gib": sum(t.numel() * t.element_size() for t in state.values()) / GIB}


def held_buffers(model) -> set[str]:
    """The state-dict names of the buffers of ``model``'s quantised modules (codes, scales, packed table rows)."""
    return {f"{name}.{buffer}" for name, module in model.named_modules()
            if isinstance(module, (QuantizedMatrix, QuantizedTable)) for buffer, _ in module.named_buffers()}


def first_and_last(tensors: Mapping) -> list[str]:
    """The first and the last name of each stored form among ``tensors`` (the first held expert of the first
    layer, the last of the last, ...): what the import's checks compare."""
    by_form: dict[released.Storage, list[str]] = {}
    for name in tensors:
        by_form.setdefault(released.storage(name), []).append(name)
    return [name for names in by_form.values() for name in dict.fromkeys((names[0], names[-1]))]


def stored_exact(name: str, slot: Slot, source, args: ModelArgs, n_layers: int, seed: int) -> bool:
    """A tensor held as stored: its codes and scales are the file's bytes (read here by ``safe_open``), and decode
    to the value written."""
    held = []
    for part, kept in ((name, slot.codes), (released.scale_name(name), slot.scale)):
        with safe_open(str(source.directory / source.weight_map[part]), framework="pt") as handle:
            piece = handle.get_slice(part)
            stored = piece[slice(*slot.rows)] if slot.rows else piece[:]
        held.append(torch.equal(kept.cpu(), stored.view(torch.uint8)))
    codes = slot.codes.view(torch.float8_e4m3fn) if slot.fmt == "fp8" else slot.codes
    value = dequantize(codes, slot.scale.view(torch.float8_e8m0fnu), slot.fmt, slot.block)
    return all(held) and torch.equal(value, written_value(name, value.shape, args, n_layers, seed, value.device))


def slot_values(slot: Slot) -> int:
    """Values a stored tensor holds (two FP4 codes a byte)."""
    return slot.codes.numel() * (2 if slot.fmt == "fp4" else 1)


def stored_form(codes, scale, fmt: str, block: tuple[int, int], *_) -> str:
    """A dequantisation's label: its format and scale block (``dequantize``'s arguments)."""
    return f"{fmt} {block[0]}x{block[1]}"


def engram_estimate(args: ModelArgs, cold: dict, quantized: dict) -> dict:
    """The released Engram tables' import at the first import's rates: read at its stored bytes per second, and
    dequantised at its FP8 rate (the tables are FP8 rows of 32; divide by the table ranks D, each reads 1/D); held
    as stored: read and copied at the ``quantized`` import's stored bytes per second, not decoded."""
    values = sum(args.engram.num_embeddings or table_rows(args.engram)) * args.engram.head_dim
    stored = values * (1 + 1 / 32)
    fp8 = [k for k in cold["dequantise_s"] if k.startswith("fp8")]
    fp8_rate = sum(cold["dequantise_stored_bytes"][k] for k in fp8) / sum(cold["dequantise_s"][k] for k in fp8)
    read_rate = cold["bytes_read"] / cold["read_s"]
    return {"values": values, "stored_gb": stored / GB, "fp32_gb": values * 4 / GB,
            "read_s": stored / read_rate, "dequantise_s": stored / fp8_rate, "seconds": stored / read_rate +
            stored / fp8_rate, "at_mean_rate_s": stored / (cold["stored_gb_per_s"] * GB),
            "held_as_stored_s": stored / (quantized["stored_gb_per_s"] * GB)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file")
    p.add_argument("--smoke", action="store_true", help="v41_mini widths on the CPU, to test this script")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda (smoke: cpu)")
    p.add_argument("--layers", default="20-23", help="first-last layers of the stage")
    p.add_argument("--expert-parallel", type=int, default=16, help="E: ranks of an expert group")
    p.add_argument("--expert-rank", type=int, default=0, help="the rank whose experts are imported")
    p.add_argument("--max-shard-size", type=parse_size, default=MAX_SHARD_BYTES, help="default 5GB")
    p.add_argument("--dir", help="the released files go in a new directory in it (default: $TMPDIR or /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the released files")
    p.add_argument("--warm", action="store_true", help="import a second time, from the page cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phase", choices=("write", "import", "import_quantized"), help=argparse.SUPPRESS)  # a child's phase
    p.add_argument("--released", help=argparse.SUPPRESS)  # and the released directory
    p.add_argument("overrides", nargs="*", help="config overrides after the preset's")
    a = p.parse_args(argv)
    a.device = a.device or ("cpu" if a.smoke else "cuda")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run on the GPU, --device cpu, or --smoke")
    if a.smoke:
        torch.set_num_threads(1)  # tiny tensors on a shared CPU
    a.config = (SMOKE if a.smoke else V41) + a.overrides
    config = resolved(compose(a.config))
    args, layout = config.model.args, layout_from_config(config.layout)
    a.layers = parse_slices(a.layers, layout.n_layers)[0]
    device = torch.device(a.device)
    if a.phase:
        result = write_phase(a, args, layout, device) if a.phase == "write" else \
            import_phase(a, device, a.phase == "import_quantized")
        Path(a.out).write_text(json.dumps(result, indent=1))
        return 0

    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("error: stopped (SIGTERM)"))  # the files are removed then too
    directory = Path(tempfile.mkdtemp(prefix="import_slice_", dir=a.dir))
    flags = ["--device", a.device, "--layers", f"{a.layers.start}-{a.layers.stop - 1}", "--expert-parallel",
             str(a.expert_parallel), "--expert-rank", str(a.expert_rank), "--max-shard-size", str(a.max_shard_size),
             "--seed", str(a.seed), "--released", str(directory), *(["--smoke"] if a.smoke else []), *a.overrides]
    res = {"config": a.config, "device": a.device, "dir": str(directory)}
    try:
        for label, phase in PHASES if a.warm else PHASES[:3]:
            part = directory / f"{label}.json"
            if subprocess.run([sys.executable, __file__, "--phase", phase, "--out", str(part), *flags]).returncode:
                sys.exit(f"error: the {label} phase failed (its error is above)")
            res[label] = json.loads(part.read_text())
            print(label, json.dumps({k: v for k, v in res[label].items() if k not in ("slice", "check")}), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(directory, ignore_errors=True)
    res["engram_tables_estimate"] = engram_estimate(args, res["import_cold"], res["import_quantized"])
    res = {**result_meta(), **res, "wall_s": time.monotonic() - started}  # after the children: no CUDA context held
    Path(a.out).write_text(json.dumps(res, indent=1))
    imports = [label for label, phase in PHASES if phase.startswith("import") and label in res]
    ok = all(res[label]["check"]["ok"] for label in imports)
    write = res["write"]
    print(f"\nwrote {write['bytes_on_disk'] / GB:.1f} GB in {write['write_s']:.0f} s (+{write['flush_s']:.0f} s "
          f"flush); {write['quantised_exact']}/{write['quantised_tensors']} quantised tensors exact")
    for label in imports:
        r, gpu = res[label], res[label]["gpu"].get("peak_allocated_gib", float("nan"))
        print(f"{label}: {r['total_s']:.1f} s (open {r['open_s']:.1f}, build {r['build_s']:.1f}, load "
              f"{r['load_s']:.1f}: read {r['read_s']:.1f}, dequantise {sum(r['dequantise_s'].values()):.1f}, fill "
              f"{r['fill_copy_s']:.1f}), {r['bytes_read'] / GB:.2f} GB "
              f"read of {r['bytes_in_files'] / GB:.1f}, host peak {r['host_gib']['peak']:.1f} GiB, GPU peak "
              f"{gpu:.1f} GiB; check {'ok' if r['check']['ok'] else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
