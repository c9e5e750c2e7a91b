#!/bin/bash
# One device call: every GPU test + memcheck, tiny-model generation on the GPU, then the peers and
# fmoe's benchmark over all shapes, methods and token counts, side by side.
# Expects (built on the dev machine, carried with the device tool): .device/bin/{fmoe, cuda_* test
# binaries} (from `cargo test --release --no-run` / `cargo build --release`, stripped) and .peers/
# (a copy of ../shared/peers). Results land in $OUT.
set -u
export FMOE_REQUIRE_CUDA=1 FMOE_CACHE_DIR=/tmp/fmoe-cache RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
B=.device/bin; T=/tmp/fmoe-logs; mkdir -p $T $FMOE_CACHE_DIR
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $T/env.txt 2>&1
for t in cuda_quant_fp8 cuda_moe_fp8 cuda_moe cuda_moe_kernels cuda_routing; do
  ( timeout 90 $B/$t > $T/$t.log 2>&1; echo "== $t rc=$? at $(( $(date +%s) - start ))s" >> $T/rc.txt ) &
done
( timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/cuda_moe small --test-threads=1 > $T/sanitizer.log 2>&1; echo "== sanitizer rc=$? at $(( $(date +%s) - start ))s" >> $T/rc.txt ) &
wait
{ cat $T/env.txt $T/rc.txt; for f in $T/*.log; do echo "######## $f"; tail -40 $f; done; } > $OUT/tests.log
cat $T/rc.txt
for m in tiny-mixtral tiny-deepseek-v3; do
  ids=$(python3 -c "import json;print(','.join(map(str,json.load(open('tests/fixtures/$m/expected.json'))['prompt_ids'][0])))")
  want=$(python3 -c "import json;print(json.load(open('tests/fixtures/$m/expected.json'))['greedy_ids'][0])")
  for fused in 0 1; do
    got=$(FMOE_USE_FUSED=$fused timeout 20 $B/fmoe generate --model tests/fixtures/$m --device cuda --prompt-ids $ids --max-tokens 16 --temperature 0 --json 2>>$OUT/generate.err | tail -1)
    echo "$m fused=$fused want=$want got=$got" >> $OUT/generate.log
  done
done
echo "== generate at $(( $(date +%s) - start ))s"; cat $OUT/generate.log | cut -c1-300
TOK=1,4,16,64,256,1024,4096,16384
timeout 140 python3 .peers/moe_peers.py --shapes mixtral-8x7b,mixtral-8x22b,deepseek-v3 --modes bf16,fp8-tensor --tokens $TOK --json $OUT/peers.jsonl > $OUT/peers.log 2>&1
echo "== peers rc=$? at $(( $(date +%s) - start ))s"
timeout 130 $B/fmoe bench moe --device cuda --shape mixtral-8x7b,mixtral-8x22b,deepseek-v3 --tokens $TOK --json $OUT/fmoe.jsonl --ceilings-json $OUT/peers.log > $OUT/bench.log 2>&1
echo "== bench rc=$? at $(( $(date +%s) - start ))s"
tail -5 $OUT/bench.log
