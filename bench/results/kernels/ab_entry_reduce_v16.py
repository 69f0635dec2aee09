"""One-off A/B of the dKV entry reduction on the GPU (2026-12-01, code 4421e49): the kernel before 'ids a block
ahead' (tmp_old_dkv.py: `git show 9c3aae6:kernels/triton_dkv.py > tmp_old_dkv.py`) against kernels/triton_dkv.py,
one backward chunk at the 64K bench's shapes (6,553 tokens x 512 slots of [512] bf16 partial rows, random entries),
kernel time only, both interleaved twice in one process; outputs compared bitwise. From the repository root, with
this file and tmp_old_dkv.py copied there: python ab_entry_reduce.py OUT.json"""
import importlib.util
import json
import sys

import torch
import triton

from kernels import triton_dkv as new

spec = importlib.util.spec_from_file_location("old_dkv", "tmp_old_dkv.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
torch.manual_seed(0)
n, W, K, D = 6553, 128, 512, 512
part = torch.randn(n, W + K, D, device="cuda", dtype=torch.bfloat16)
result = {"command": "python ab_entry_reduce.py $OUT/ab_entry_reduce.json", "machine": torch.cuda.get_device_name(),
          "torch": torch.__version__, "triton": triton.__version__, "date": "2026-12-01", "gb_read": n * K * D * 2 / 1e9}
for entries_n in (16384, 65536):
    entries = torch.randint(0, entries_n, (n, K), device="cuda")
    entries[torch.rand(n, K, device="cuda") < 0.05] = -1
    order, offsets = new.inverse_index(entries, entries_n)
    outs, row = {}, {}
    for name, mod in (("old", old), ("new", new), ("old_again", old), ("new_again", new)):
        dkv = torch.zeros(entries_n, D, device="cuda")
        run = lambda: mod._entry_reduce_kernel[(entries_n,)](part, order, offsets, dkv, W=W, K=K, D=D)
        run()  # autotunes (restore_value keeps dkv)
        dkv.zero_()
        run()
        outs[name] = dkv.clone()
        row[name + "_ms"] = triton.testing.do_bench(run, warmup=50, rep=300)
        row[name + "_config"] = str(mod._entry_reduce_kernel.best_config)
    row["bitwise_equal"] = all(torch.equal(outs["old"], o) for o in outs.values())
    row["tb_per_s_new"] = result["gb_read"] / min(row["new_ms"], row["new_again_ms"])
    row["tb_per_s_old"] = result["gb_read"] / min(row["old_ms"], row["old_again_ms"])
    result[f"entries_{entries_n}"] = row
    print(entries_n, json.dumps(row), flush=True)
json.dump(result, open(sys.argv[1], "w"), indent=1)
