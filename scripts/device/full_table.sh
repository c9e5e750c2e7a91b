#!/usr/bin/env bash
# Device side of a final check (run by the device tool in the repository root; results under
# $OUT): the peers' ceilings and timings, fmoe's full table (every shape × method × M of issues 3
# and 4, fused), fused vs portable at 1, 64, 4096, two more rounds of the Mixtral-8x7B fp8 / bf16
# ratio, of DeepSeek-V3 fp8-block at 1-2048 and of bf16's large-M rows, every GPU test binary, and
# compute-sanitizer on the MoE kernels. Tables from the results: scripts/device/tables.py full DIR.
#
#   bash scripts/device/full_table.sh NAME      (after scripts/device/bundle.sh NAME)
set -u
# Every step has its own timeout: a kernel that hangs costs one step, not the call.
D=.device/${1:?usage: full_table.sh NAME}; O=$OUT
S=$O/summary.txt; T=$O/tests.log; L=$O/bench.log
t0=$(date +%s)
stamp() { echo "$1 $(( $(date +%s) - t0 )) s" >> "$S"; }
mkdir -p "$D/bin" target/release && tar xJf "$D/bin.tar.xz" -C "$D/bin" && cp "$D/bin/fmoe" target/release/fmoe
export FMOE_REQUIRE_CUDA=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$S"
B=$D/bin/fmoe
TOK=1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384
SHAPES=mixtral-8x7b,mixtral-8x22b,deepseek-v3
timeout 200 python3 .peers/moe_peers.py --shapes $SHAPES --modes bf16,fp8-tensor --tokens $TOK \
  --json "$O/peers.jsonl" > "$O/peers.log" 2>&1
stamp "peers rc=$?"
timeout 240 $B bench moe --device cuda --shape $SHAPES --kernel fused --tokens $TOK \
  --ceilings-json "$O/peers.log" --json "$O/fused.jsonl" >> "$L" 2>&1
stamp "fused rc=$?"
timeout 120 $B bench moe --device cuda --shape $SHAPES --kernel fused,portable --tokens 1,64,4096 \
  --ceilings-json "$O/peers.log" --json "$O/portable.jsonl" >> "$L" 2>&1
stamp "portable rc=$?"
for r in 1 2; do
  timeout 60 $B bench moe --device cuda --shape mixtral-8x7b --method unquantized,fp8-tensor --kernel fused \
    --tokens 1,2,4,8,16,32,64,128,256 --ceilings-json "$O/peers.log" --json "$O/ratio.jsonl" >> "$L" 2>&1
  timeout 60 $B bench moe --device cuda --shape deepseek-v3 --method fp8-block --kernel fused --tokens 1,1024,1536,2048 \
    --ceilings-json "$O/peers.log" --json "$O/ratio.jsonl" >> "$L" 2>&1
  timeout 90 $B bench moe --device cuda --shape mixtral-8x7b,deepseek-v3 --method unquantized --kernel fused \
    --tokens 512,1024,4096,8192,16384 --ceilings-json "$O/peers.log" --json "$O/ratio.jsonl" >> "$L" 2>&1
done
stamp "ratio rc=$?"
for b in "$D"/bin/tests/*; do
  n=$(basename "$b"); [ "$n" = nvrtc_compile ] && continue  # CI runs it
  echo "=== $n" >> "$T"
  timeout 240 "$b" --test-threads 1 >> "$T" 2>&1
  echo "$n rc=$? $(grep 'test result' "$T" | tail -1 | cut -c1-60)" >> "$S"
done
stamp "tests done"
san() { # tool, test binary, filter
  echo "=== $1 $2 $3" >> "$T"
  timeout 200 compute-sanitizer --tool "$1" "$D/bin/tests/$2" "$3" --test-threads 1 >> "$T" 2>&1
  echo "$1 $2 $3 rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$T" | tail -1)" >> "$S"
}
san memcheck cuda_moe_fp8 sanitizer
san memcheck cuda_moe mixed_tile_edges
san memcheck cuda_moe_kernels swap_ab
san racecheck cuda_moe_fp8 sanitizer_large
san synccheck cuda_moe_fp8 sanitizer_large
san synccheck cuda_moe mixed_tile_edges
san memcheck cuda_moe_kernels persistent_swap_ab
san racecheck cuda_moe_kernels persistent_swap_ab
san synccheck cuda_moe_kernels persistent_swap_ab
# The promotion test's child alone (experts whose last blocks leave the second MMA warpgroup idle).
export FMOE_TEST_PROMOTION_DUMP=/tmp/promotion.bin
for tool in memcheck racecheck synccheck; do
  san $tool cuda_fp8_promotion promotion_schedules_give_the_same_bits
done
unset FMOE_TEST_PROMOTION_DUMP
stamp "sanitizers done"
# The device tool returns at most 8 files: the logs go back compressed.
gzip -f "$T" "$L"
