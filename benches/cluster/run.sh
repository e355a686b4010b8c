#!/usr/bin/env bash
# The largest cluster load these machines allow (issue #8, docs/SCALING.md):
# three gpulse nodes on 127.0.0.1, replication factor 2, a simulated fleet at
# 1 Hz streamed over the agent protocol to each owner of every rack (as
# `gpulse agent --sharded` does), as fast as the nodes ack: saturation. Then
# the query set through one node, answered for the whole cluster.
#
#   benches/cluster/run.sh            # GPUS=1000 SPAN=10m
#   GPUS=200 SPAN=2m benches/cluster/run.sh
#
# Settings (environment): GPUS, SPAN, REPS (query repetitions, default 10),
# GPULSE_BIN (default: build `--release`; gpulse-bench is the one beside
# it, or BENCH_BIN), OUT (default target/cluster-bench).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
GPUS=${GPUS:-1000} SPAN=${SPAN:-10m} REPS=${REPS:-10}
OUT=${OUT:-$ROOT/target/cluster-bench}
WORK=$(mktemp -d /tmp/gpulse-cluster.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
say() { printf '\n== %s\n' "$*"; }

if [ -n "${GPULSE_BIN:-}" ]; then
  BIN=$GPULSE_BIN
else
  say "building gpulse and gpulse-bench (--release)"
  (cd "$ROOT" && cargo build --release --bin gpulse --bin gpulse-bench)
  BIN=$ROOT/target/release/gpulse
fi
BENCH=${BENCH_BIN:-$(dirname "$BIN")/gpulse-bench}
[ -x "$BENCH" ] || { echo "no gpulse-bench binary at $BENCH (cargo build -p gpulse-bench, or set BENCH_BIN)" >&2; exit 2; }
mkdir -p "$OUT"

FILE=$WORK/cluster.toml
printf 'replication_factor = 2\n' > "$FILE"
IDS=(a b c)
for i in 0 1 2; do
  base=$((37400 + 10 * i))
  printf '\n[[node]]\nid = "%s"\ngrpc = "127.0.0.1:%d"\nhttp = "127.0.0.1:%d"\nflight = "127.0.0.1:%d"\n' \
    "${IDS[$i]}" "$base" $((base + 1)) $((base + 3)) >> "$FILE"
done

NODE_PIDS=()
for i in 0 1 2; do
  "$BIN" serve --cluster "$FILE" --node-id "${IDS[$i]}" --data-dir "$WORK/${IDS[$i]}" \
    --pg-listen off --flush-interval 2m > "$WORK/${IDS[$i]}.log" 2>&1 &
  PIDS+=("$!"); NODE_PIDS+=("$!")
done
for i in 0 1 2; do
  for _ in $(seq 600); do
    curl -fsS -o /dev/null "http://127.0.0.1:$((37401 + 10 * i))/api/v1/status/buildinfo" 2>/dev/null && break
    sleep 0.1
  done
done

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)
declare -A CPU0
for p in "${NODE_PIDS[@]}"; do CPU0[$p]=$(cpu_ticks "$p"); done

END_MS=$(( $(date +%s) * 1000 ))
say "loading $GPUS GPUs x $SPAN at 1 Hz into 3 nodes (RF 2), as fast as acked"
"$BENCH" ingest --cluster "$FILE" --gpus "$GPUS" --interval 1s --span "$SPAN" \
  --end-ms "$END_MS" --json "$OUT/ingest.jsonl"

TOTAL=0
for i in 0 1 2; do
  p=${NODE_PIDS[$i]}
  t=$(( $(cpu_ticks "$p") - CPU0[$p] ))
  TOTAL=$((TOTAL + t))
  rss=$(awk '/VmHWM/ {print $2}' "/proc/$p/status")
  printf 'node %s: %.1f CPU-s, peak RSS %d MiB\n' "${IDS[$i]}" "$(awk -v t="$t" -v hz="$HZ" 'BEGIN { print t / hz }')" $((rss / 1024))
done
python3 - "$OUT/ingest.jsonl" "$TOTAL" "$HZ" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
cpu = int(sys.argv[2]) / int(sys.argv[3])
acked = r["samples_acked"]
print(f"stored (both replicas): {acked} samples in {r['wall_s']:.1f} s = {acked / r['wall_s']:,.0f} samples/s")
print(f"distinct samples/s:     {acked / 2 / r['wall_s']:,.0f}")
print(f"all nodes' CPU:          {cpu:.1f} s -> {acked / cpu:,.0f} stored samples/s per core")
print(f"ack latency:             p50 {r['ack_p50_ms']:.1f} ms, p99 {r['ack_p99_ms']:.1f} ms")
PY

say "query set through node a (answers for the whole cluster)"
"$BENCH" query --url http://127.0.0.1:37401 --sql --at-ms "$END_MS" --reps "$REPS" \
  --system gpulse-cluster --json "$OUT/query.jsonl"

say "cluster status"
"$BIN" cluster status --cluster "$FILE"
