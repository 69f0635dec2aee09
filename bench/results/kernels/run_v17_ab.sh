#!/bin/bash
# The v17 A/B (branch wip/fwd-tma-stage), in two steps:
#   bash bench/results/kernels/run_v17_ab.sh prepare   # here, in the checkout: the variants' module files (git show;
#                                                      # tmp_*.py, removed after the call)
#   bash bench/results/kernels/run_v17_ab.sh run dkv check   # on the GPU machine (device tool), results under $OUT;
#   bash bench/results/kernels/run_v17_ab.sh run fwd         # a second call (each part's time is beside it below)
#   bash bench/results/kernels/run_v17_ab.sh run l2          # a third: the staged p kept in L2 (after the first two)
#   bash bench/results/kernels/run_v17_ab.sh run lay         # a fourth: the mass from a tile of 16 heads a thread
# Forward variants, each on top of the one before: old (f53e55d, v16's kernel), tma (P staged by TMA), cs (the
# output stored streaming), overlap (a token's mass summed under the next token's first S), prefetch (the next
# token's q asked of L2), rows (the next pair's rows asked of L2 too). dKV step: old (f53e55d), prefetch (5bd0df7:
# the next token's q, dO and O asked of L2), halves (82d2b15: the block's buffer freed and refilled by halves of
# the features), rows (1da163c, the branch head: the next block's rows asked of L2 too). `check` checks the
# checkout's kernels: its result file was made on the branch head.
set -euo pipefail
case "${1:-}" in
prepare)
    # each variant with the gluon_common of its commit (tmp_common_<name>.py, a top-level module)
    for variant in fwd:old:f53e55d fwd:tma:dbc9106 fwd:cs:fe56b34 fwd:overlap:8a4e90b fwd:prefetch:96bc8a5 \
                   fwd:rows:5bd0df7 dkv:old:f53e55d dkv:prefetch:5bd0df7 dkv:halves:82d2b15 dkv:rows:1da163c; do
        IFS=: read -r kind name sha <<< "$variant"
        module=$([ "$kind" = fwd ] && echo gluon_attention || echo gluon_dkv)
        git show "$sha:kernels/gluon_common.py" > "tmp_common_${kind}_$name.py"
        git show "$sha:kernels/$module.py" \
            | sed "s/^from kernels.gluon_common import/from tmp_common_${kind}_$name import/" > "tmp_${kind}_$name.py"
    done
    # After the A/B above: l2 (main's 2690ac7, the staged p kept in L2), and l2out (l2 with the output stored
    # evict_first too)
    git show 2690ac7:kernels/gluon_attention.py \
        | sed "s/^from kernels.gluon_common import/from tmp_common_fwd_old import/" > tmp_fwd_l2.py
    python3 - <<'PY'
source = open("tmp_fwd_l2.py").read()
store = "(out_heads < H)[:, None])"
assert source.count(store) == 1
open("tmp_fwd_l2out.py", "w").write(source.replace(store, store[:-1] + ', eviction_policy="evict_first")'))
PY
    # on top of l2: lay (the mass from one tile of 16 heads a thread) and early (its loads before the output; the
    # result file names it tmp_fwd_early_full.py)
    for name in lay early; do
        patch -s -o "tmp_fwd_$name.py" tmp_fwd_l2.py < "bench/results/kernels/ab_fwd_v17_$name.patch"
    done ;;
run)  # parts: check (attention and dKV-step checks, ~3 min), fwd (the forward A/B, ~5 min), dkv (~2 min); each
      # under a timeout (SIGTERM), so that a variant that hangs costs its part, not the call
    cp bench/results/kernels/ab_gluon_v17.py ab_gluon.py
    export PYTHONPATH=$PWD:$PWD/bench
    nvidia-smi --query-gpu=memory.used --format=csv
    for part in "${@:2}"; do
        case "$part" in
        check) timeout 300 python3 bench/bench_kernels.py check --only check_attention,check_dkv_step \
                   --out "$OUT/check_dev_v17.json" 2>&1 | tail -30 || echo "check: exit $?" ;;
        fwd) timeout 480 python3 ab_gluon.py "$OUT/ab_fwd_v17.json" kernels.gluon_attention old=tmp_fwd_old.py \
                 tma=tmp_fwd_tma.py cs=tmp_fwd_cs.py overlap=tmp_fwd_overlap.py prefetch=tmp_fwd_prefetch.py \
                 rows=tmp_fwd_rows.py 2>&1 | grep -v '^ ' | tail -20 || echo "fwd: exit $?" ;;
        dkv) timeout 200 python3 ab_gluon.py "$OUT/ab_dkv_v17.json" kernels.gluon_dkv old=tmp_dkv_old.py \
                 prefetch=tmp_dkv_prefetch.py halves=tmp_dkv_halves.py rows=tmp_dkv_rows.py 2>&1 \
                 | grep -v '^ ' | tail -10 || echo "dkv: exit $?" ;;
        l2) timeout 400 python3 ab_gluon.py "$OUT/ab_fwd_v17_l2.json" kernels.gluon_attention old=tmp_fwd_old.py \
                l2=tmp_fwd_l2.py l2out=tmp_fwd_l2out.py 2>&1 | grep -v '^ ' | tail -10 || echo "l2: exit $?" ;;
        lay) timeout 400 python3 ab_gluon.py "$OUT/ab_fwd_v17_lay.json" kernels.gluon_attention l2=tmp_fwd_l2.py \
                 old=tmp_fwd_old.py lay=tmp_fwd_lay.py early=tmp_fwd_early.py 2>&1 | grep -v '^ ' | tail -10 \
                 || echo "lay: exit $?" ;;
        *) echo "unknown part $part" >&2; exit 2 ;;
        esac
    done ;;
*)
    echo "usage: $0 prepare | run check|fwd|dkv|l2|lay ..." >&2; exit 2 ;;
esac
