#!/usr/bin/env bash
# Tests monarch-plan as a user runs it: exit codes, output, and one-line errors.
set -uo pipefail
MP=${MONARCH_PLAN:?set MONARCH_PLAN to the monarch-plan binary}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
GPT3="--layers 96 --hidden 12288 --heads 96 --seq 2048 --vocab 51200 --global-batch 1536"
passed=0
failed=0

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

# expect_error "name" "expected substring" command...: non-zero exit, exactly one stderr line
# containing the substring, no crash (exit status < 128).
expect_error() {
  local name=$1 want=$2; shift 2
  "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  local lines
  lines=$(wc -l <"$TMP/err")
  if [ "$rc" -eq 0 ] || [ "$rc" -ge 128 ]; then bad "$name: exit status $rc"; return; fi
  if [ "$lines" -ne 1 ]; then bad "$name: $lines stderr lines: $(cat "$TMP/err")"; return; fi
  if ! grep -qF -- "$want" "$TMP/err"; then bad "$name: stderr '$(cat "$TMP/err")' lacks '$want'"; return; fi
  ok
}

# 1. Plan GPT-3 175B on 1024 GPUs, write, validate, show.
if "$MP" transformer $GPT3 --gpus 1024 --cluster a100-80gb -o "$TMP/plan.json" >"$TMP/out" 2>"$TMP/err"; then
  grep -q "TFLOP/s per device" "$TMP/out" && grep -q "alternatives" "$TMP/out" && ok || bad "summary incomplete: $(cat "$TMP/out")"
else
  bad "planning GPT-3 failed: $(cat "$TMP/err")"
fi
"$MP" validate "$TMP/plan.json" >"$TMP/out" 2>&1 && grep -q "valid plan" "$TMP/out" && ok || bad "validate: $(cat "$TMP/out")"
"$MP" show "$TMP/plan.json" >"$TMP/out" 2>&1 && grep -q "step time" "$TMP/out" && ok || bad "show: $(cat "$TMP/out")"

# 2. A fully pinned layout is scored as given.
"$MP" transformer $GPT3 --gpus 384 --tp 8 --pp 12 --dp 4 --zero 0 --micro-batch 1 --schedule 1f1b \
  --recompute full --json >"$TMP/pinned.json" 2>"$TMP/err" || bad "pinned: $(cat "$TMP/err")"
grep -q '"tp": 8' "$TMP/pinned.json" && grep -q '"pp": 12' "$TMP/pinned.json" && ok || bad "pinned layout not kept"

# 3. Bad input: one line, non-zero exit.
expect_error "tp not dividing heads" "does not divide heads=32" \
  "$MP" transformer --layers 4 --hidden 4096 --heads 32 --seq 2048 --vocab 32000 --global-batch 8 --gpus 6 --cluster h100-80gb --tp 3
expect_error "world not a product" "does not match the world size" \
  "$MP" transformer $GPT3 --gpus 384 --tp 8 --pp 12 --dp 2
expect_error "unknown preset" "unknown preset 'tpu-v9'" \
  "$MP" transformer $GPT3 --gpus 8 --cluster tpu-v9
expect_error "not an integer" "--layers: expected an integer" \
  "$MP" transformer --layers many --hidden 1 --heads 1 --seq 1 --vocab 1 --global-batch 1 --gpus 1
expect_error "unknown option" "unknown option '--tensor'" "$MP" transformer --tensor 2
expect_error "nothing fits" "no layout fits" "$MP" transformer $GPT3 --gpus 8 --cluster a100-40gb

printf '{"version": 1, "mesh": ' >"$TMP/truncated.json"
expect_error "malformed json" "parse error" "$MP" validate "$TMP/truncated.json"
sed 's/"version": 1/"version": 99/' "$TMP/plan.json" >"$TMP/v99.json"
expect_error "unknown version" "version" "$MP" validate "$TMP/v99.json"
# Change tp from 8 without changing the cluster: pp*dp*tp no longer equals the world.
python3 - "$TMP/plan.json" "$TMP/badmesh.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
plan["mesh"]["dp"] = plan["mesh"]["dp"] * 3
json.dump(plan, open(sys.argv[2], "w"), indent=1)
PY
expect_error "mesh vs world" "does not equal the cluster's world size" "$MP" validate "$TMP/badmesh.json"
expect_error "missing file" "cannot read plan file" "$MP" validate "$TMP/nope.json"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
