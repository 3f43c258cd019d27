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
expect_error "unknown version" "version: plan format version 99 is not supported" "$MP" validate "$TMP/v99.json"
# Change tp from 8 without changing the cluster: pp*dp*tp no longer equals the world.
python3 - "$TMP/plan.json" "$TMP/badmesh.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
plan["mesh"]["dp"] = plan["mesh"]["dp"] * 3
json.dump(plan, open(sys.argv[2], "w"), indent=1)
PY
expect_error "mesh vs world" "does not equal the cluster's world size" "$MP" validate "$TMP/badmesh.json"
expect_error "missing file" "cannot read plan file" "$MP" validate "$TMP/nope.json"
# A number no double holds: a FormatError with its position, not a library exception.
sed '0,/"step_time_s": [^,]*/s//"step_time_s": 1e400/' "$TMP/plan.json" >"$TMP/huge_number.json"
expect_error "number beyond a double" "number overflow parsing '1e400'" "$MP" validate "$TMP/huge_number.json"

# 4. Hostile numbers: one clear line each, no crash, no hang, no runaway allocation
# (the address space is capped at 4 GB for these).
TINY="--layers 2 --hidden 64 --heads 4 --seq 16 --vocab 100"
hostile() { (ulimit -v 4000000; timeout 60 "$@"); }
expect_error "zero gpus" "cluster.devices: must be in [1, 2147483648], got 0" \
  hostile "$MP" transformer $TINY --global-batch 8 --gpus 0
expect_error "negative gpus" "cluster.devices: must be in [1, 2147483648], got -8" \
  hostile "$MP" transformer $TINY --global-batch 8 --gpus -8
expect_error "huge gpus" "cluster.devices: must be in [1, 2147483648]" \
  hostile "$MP" transformer $TINY --global-batch 8 --gpus 9223372036854775807 --cluster cpu
expect_error "negative batch" "training.global_batch: must be >= 1, got -8" \
  hostile "$MP" transformer $TINY --global-batch -8 --gpus 1
expect_error "huge batch" "too large a schedule" \
  hostile "$MP" transformer $TINY --global-batch 9223372036854775807 --gpus 1 --cluster cpu
expect_error "huge batch, pinned pp" "too large a schedule" \
  hostile "$MP" transformer $TINY --global-batch 67108864 --gpus 8 --pp 2 --micro-batch 1
expect_error "huge schedule" "num_micro_batches: pp=100000 x 100000 micro-batches x 1 virtual stages is too large" \
  hostile "$MP" schedule --schedule 1f1b --pp 100000 --micro-batches 100000
expect_error "huge hidden" "transformer.hidden: 4000000000 is too large" \
  hostile "$MP" transformer --layers 2 --hidden 4000000000 --heads 4 --seq 16 --vocab 100 --global-batch 8 --gpus 1
expect_error "huge layers" "transformer.layers: 200000000 is too large" \
  hostile "$MP" transformer --layers 200000000 --hidden 64 --heads 4 --seq 16 --vocab 100 --global-batch 8 --gpus 1
expect_error "fp8 on a100" "cluster.peak_flops_fp8: must be > 0 for compute_dtype fp8" \
  hostile "$MP" transformer $TINY --global-batch 8 --gpus 2 --cluster a100-80gb --dtype fp8
expect_error "negative alternatives" "alternatives: must be >= 0, got -1" \
  hostile "$MP" transformer $TINY --global-batch 8 --gpus 2 --alternatives -1
expect_error "negative micro-batch" "pins.micro_batch_size: must be >= 1, got -1" \
  hostile "$MP" transformer $TINY --global-batch 8 --gpus 2 --micro-batch -1
expect_error "micro-batch not dividing" "micro-batch size 3 does not divide" \
  hostile "$MP" transformer $TINY --global-batch 8 --gpus 2 --cluster cpu --dp 2 --micro-batch 3
expect_error "interleaving without a pipeline" "virtual_stages=2 needs pp > 1" \
  hostile "$MP" transformer $TINY --global-batch 8 --gpus 1 --cluster cpu --virtual-stages 2

# 5. A tied embedding counts once: this one needs 6.3 of the 7.5 GiB usable.
"$MP" transformer --layers 1 --hidden 1024 --heads 8 --seq 16 --vocab 400000 --tied-embeddings \
  --global-batch 1 --gpus 1 --cluster cpu >"$TMP/out" 2>"$TMP/err" && ok || bad "tied embedding: $(cat "$TMP/err")"

# 6. Embedding tables: planned with a pin, written, and impossible pins refused in one line.
cat >"$TMP/tables.json" <<'JSON'
[{"name": "user", "rows": 400000000, "dim": 128},
 {"name": "item", "rows": 5000000, "dim": 64, "features": ["item", "clicked"], "pooling_factor": 20},
 {"name": "country", "rows": 250, "dim": 16}]
JSON
if "$MP" embeddings "$TMP/tables.json" --gpus 16 --batch-per-rank 512 --optimizer rowwise_adagrad \
    --table country=data_parallel --table item=row_wise -o "$TMP/emb.json" >"$TMP/out" 2>"$TMP/err"; then
  grep -q "country (250 x 16): data_parallel" "$TMP/out" && grep -q "item (5000000 x 64): row_wise" "$TMP/out" &&
    grep -q "lower bound" "$TMP/out" && grep -q '"sharding": "row_wise"' "$TMP/emb.json" && ok ||
    bad "embeddings: $(cat "$TMP/out")"
else
  bad "embeddings failed: $(cat "$TMP/err")"
fi
expect_error "table too large for a rank" "embeddings.tables.user.sharding: pinned to table_wise" \
  "$MP" embeddings "$TMP/tables.json" --gpus 16 --batch-per-rank 512 --table user=table_wise
expect_error "unknown sharding" "unknown sharding 'diagonal'" \
  "$MP" embeddings "$TMP/tables.json" --gpus 16 --batch-per-rank 512 --table user=diagonal
expect_error "pin of no table" "embeddings.pins.nope: no table has this name" \
  "$MP" embeddings "$TMP/tables.json" --gpus 16 --batch-per-rank 512 --table nope=row_wise

# 7. A measured profile replaces the analytic layer times; one of another model is refused.
python3 - "$TMP/profile.json" <<'PY'
import json, sys
layers = ["embedding", "blocks.0", "blocks.1", "final_norm", "lm_head"]
points = lambda f: [{"micro_batch": 1, "forward_s": f, "backward_s": 2 * f}]
json.dump({"format": "monarch-profile", "version": 1, "source": "cli test",
           "layers": [{"name": n, "points": points(0.5 if n.startswith("blocks") else 0.01)} for n in layers],
           "links": {"intra_node": {"latency_s": 1e-4, "bytes_per_s": 1e9}}}, open(sys.argv[1], "w"))
PY
if "$MP" transformer --layers 2 --hidden 64 --heads 4 --seq 32 --vocab 100 --global-batch 8 --gpus 2 --cluster cpu \
    --profile "$TMP/profile.json" --tie-tolerance 0 >"$TMP/out" 2>"$TMP/err"; then
  grep -q "layer times from the profile: cli test" "$TMP/out" && ! grep -q "tie break" "$TMP/out" && ok ||
    bad "profile: $(cat "$TMP/out")"
else
  bad "profile failed: $(cat "$TMP/err")"
fi
expect_error "profile of another model" "profile.layers: no measurement for layer 'blocks.2'" \
  "$MP" transformer --layers 3 --hidden 64 --heads 4 --seq 32 --vocab 100 --global-batch 8 --gpus 2 --cluster cpu \
  --profile "$TMP/profile.json"
expect_error "tie tolerance" "tie_tolerance: must be in [0, 1)" \
  "$MP" transformer --layers 2 --hidden 64 --heads 4 --seq 32 --vocab 100 --global-batch 8 --gpus 2 --cluster cpu \
  --tie-tolerance 2

# The HTML report and the diff of two plans.
if "$MP" report "$TMP/plan.json" -o "$TMP/plan.html" >"$TMP/out" 2>"$TMP/err"; then
  grep -q 'class="timeline-row"' "$TMP/plan.html" && grep -q 'class="memory-limit"' "$TMP/plan.html" && ok ||
    bad "report lacks the timeline or the memory limit"
else
  bad "report failed: $(cat "$TMP/err")"
fi
expect_error "report without -o" "report needs -o FILE.html" "$MP" report "$TMP/plan.json"
expect_error "report of a missing trace" "cannot read trace file" \
  "$MP" report "$TMP/plan.json" -o "$TMP/x.html" --trace "$TMP/none.json"
echo '{"traceEvents":[]}' >"$TMP/not_ours.json"
expect_error "report of a foreign trace" "otherData.format" \
  "$MP" report "$TMP/plan.json" -o "$TMP/x.html" --trace "$TMP/not_ours.json"
"$MP" diff "$TMP/plan.json" "$TMP/plan.json" >"$TMP/out" 2>&1 && grep -q "plans are identical" "$TMP/out" && ok ||
  bad "diff of a plan with itself: $(cat "$TMP/out")"
"$MP" diff "$TMP/plan.json" "$TMP/pinned.json" >"$TMP/out" 2>&1 && grep -q "step time:" "$TMP/out" && ok ||
  bad "diff: $(cat "$TMP/out")"
expect_error "diff of one plan" "diff needs exactly two plan files" "$MP" diff "$TMP/plan.json"

# 8. Hierarchical dp reduction: chosen across 2 nodes x 8 with 8 dp ranks per node, compressed
# only when allowed, flat when switched off; validation of a hand-edited plan.
DP16="--layers 2 --hidden 64 --heads 4 --seq 16 --vocab 100 --global-batch 16 --gpus 16 --cluster a100-80gb
  --tp 1 --pp 1 --dp 16 --zero 0 --micro-batch 1 --schedule none"
if "$MP" transformer $DP16 -o "$TMP/hier.json" >"$TMP/out" 2>"$TMP/err"; then
  grep -q '"dp_reduction": "hierarchical"' "$TMP/hier.json" && grep -q "dp_reduction=hierarchical" "$TMP/out" &&
    [ "$(grep -c '"inter_node_compression": "none"' "$TMP/hier.json")" -eq 2 ] && ok || bad "hierarchical: $(cat "$TMP/out")"
else
  bad "hierarchical plan failed: $(cat "$TMP/err")"
fi
"$MP" validate "$TMP/hier.json" >"$TMP/out" 2>&1 && ok || bad "validate hierarchical: $(cat "$TMP/out")"
"$MP" transformer $DP16 --inter-node-compression int8 --json >"$TMP/int8.json" 2>"$TMP/err" &&
  [ "$(grep -c '"inter_node_compression": "int8"' "$TMP/int8.json")" -eq 2 ] && ok || bad "int8: $(cat "$TMP/err")"
"$MP" transformer $DP16 --hierarchical-dp off --json >"$TMP/flat.json" 2>"$TMP/err" &&
  grep -q '"dp_reduction": "flat"' "$TMP/flat.json" && grep -q '"allow_hierarchical_dp": false' "$TMP/flat.json" && ok ||
  bad "hierarchical off: $(cat "$TMP/err")"
"$MP" diff "$TMP/flat.json" "$TMP/hier.json" >"$TMP/out" 2>&1 && grep -q "dp_reduction: flat -> hierarchical" "$TMP/out" && ok ||
  bad "diff of the reductions: $(cat "$TMP/out")"
expect_error "unknown compression" "--inter-node-compression: unknown compression 'zstd' (expected one of none, bf16, int8)" \
  "$MP" transformer $DP16 --inter-node-compression zstd
# The 2-GPU plan of section 1's kind, edited to hierarchical: one node.
"$MP" transformer $TINY --global-batch 8 --gpus 2 --dp 2 --tp 1 --pp 1 -o "$TMP/one_node.json" >/dev/null 2>&1
sed 's/"dp_reduction": "flat"/"dp_reduction": "hierarchical"/' "$TMP/one_node.json" >"$TMP/one_node_hier.json"
expect_error "hierarchical on one node" "dp_reduction: hierarchical needs the dp group to span nodes with >1 rank per node; dp=2 tp=1 on 1 node of 2 devices" \
  "$MP" validate "$TMP/one_node_hier.json"
sed 's/"inter_node_compression": "none",/"inter_node_compression": "bf16",/' "$TMP/one_node.json" >"$TMP/one_node_bf16.json"
expect_error "compression without hierarchical" "inter_node_compression: bf16 compresses the inter-node hop" \
  "$MP" validate "$TMP/one_node_bf16.json"

# Inference: latency and throughput plans of Llama-3-8B on 8 H100s, saved, validated, shown and
# diffed; a model that does not fit is one error naming the memory; training-only flags refused.
L8B="--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --gated-mlp --vocab 128256 --cluster h100-80gb"
"$MP" transformer $L8B --gpus 8 --mode inference --batch 1 --prompt-len 1024 --max-new-tokens 256 \
  -o "$TMP/lat.json" >"$TMP/out" 2>"$TMP/err" && grep -q "why         latency: tp=8" "$TMP/out" && ok ||
  bad "inference latency: $(cat "$TMP/out" "$TMP/err")"
"$MP" transformer $L8B --gpus 8 --mode inference --batch 1 --prompt-len 1024 --max-new-tokens 256 \
  --latency-target-ms 50 -o "$TMP/thr.json" >"$TMP/out" 2>"$TMP/err" && grep -q "tokens/s" "$TMP/out" && ok ||
  bad "inference throughput: $(cat "$TMP/out" "$TMP/err")"
"$MP" validate "$TMP/thr.json" >"$TMP/out" 2>&1 && grep -q "valid plan" "$TMP/out" && ok || bad "validate inference: $(cat "$TMP/out")"
"$MP" show "$TMP/lat.json" >"$TMP/out" 2>&1 && grep -q "time to first token" "$TMP/out" && ok || bad "show inference: $(cat "$TMP/out")"
"$MP" diff "$TMP/lat.json" "$TMP/thr.json" >"$TMP/out" 2>&1 && grep -q "mode: inference latency -> inference throughput" "$TMP/out" && ok ||
  bad "diff inference: $(cat "$TMP/out")"
expect_error "inference does not fit" "inference: no layout fits in memory: the smallest need is" \
  "$MP" transformer --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --gated-mlp --vocab 128256 \
  --cluster h100-80gb --gpus 1 --mode inference --batch 1 --prompt-len 1024 --max-new-tokens 256
expect_error "inference flag without the mode" "--batch needs --mode inference" \
  "$MP" transformer $L8B --seq 1024 --global-batch 8 --gpus 8 --batch 4
expect_error "training flag with inference" "--zero is a training option" \
  "$MP" transformer $L8B --gpus 8 --mode inference --batch 1 --prompt-len 16 --max-new-tokens 16 --zero 1

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
