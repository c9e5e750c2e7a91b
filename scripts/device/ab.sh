#!/usr/bin/env bash
# Device side of an A/B timing call: one fmoe binary, the settings (environment assignments, e.g.
# FMOE_DEV_EXTRA_DEFINES=...) alternating round by round, every round's rows of a setting appended
# to $OUT/bench_<setting>_rall.jsonl (one file a setting: the device tool returns at most 8).
# Tables: scripts/device/tables.py ab DIR base,setting2,...
# Ceilings are fixed (CEIL, JSON as the peers print them) so ×floor compares across settings.
#
#   bash scripts/device/ab.sh NAME ROUNDS "BENCH ARGS" base= name2='VAR=value ...' ...
#   (after scripts/device/bundle.sh NAME)
set -u
D=.device/${1:?usage: ab.sh NAME ROUNDS "BENCH ARGS" setting=ENV...}; R=${2:?}; ARGS=${3:?}; shift 3
[ -x "$D/bin/fmoe" ] || { mkdir -p "$D/bin" && tar xJf "$D/bin.tar.xz" -C "$D/bin"; }
C=$OUT/ceilings.json
fixed='{"bw_TBps": 4.26, "bf16_TFLOPs": 785, "fp8_TFLOPs": 1359}'
[ -f "$C" ] || echo "${CEIL:-$fixed}" > "$C"
for r in $(seq 1 "$R"); do
  for kv in "$@"; do
    n=${kv%%=*}; envs=${kv#*=}
    # shellcheck disable=SC2086 # ARGS and envs are word lists
    env $envs timeout "${AB_TIMEOUT:-300}" "$D/bin/fmoe" bench moe --device cuda $ARGS --no-reference \
      --ceilings-json "$C" --json "$OUT/bench_${n}_rall.jsonl" >> "$OUT/ab.log" 2>&1
    echo "ab $n r$r rc=$?" >> "$OUT/summary.txt"
  done
done
gzip -f "$OUT/ab.log"
