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
# Then, unless SINGLE=0, the same fleet and query set in one node, and the
# cluster-vs-one-node p50 ratios.
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

say "bytes between nodes: an aggregation pushed down, and the raw samples it covers"
# What nodes b and c sent node a over Flight (Arrow IPC message bytes).
flight_bytes() {
  local total=0 b
  for i in 1 2; do
    b=$(curl -fsS "http://127.0.0.1:$((37401 + 10 * i))/metrics" | awk '/^gpulse_flight_bytes_sent_total / {print $2}')
    total=$((total + ${b:-0}))
  done
  echo "$total"
}
SPAN_S=$(python3 -c "import sys; s=sys.argv[1]; print(int(s[:-1]) * {'s': 1, 'm': 60, 'h': 3600}[s[-1]])" "$SPAN")
START_S=$(( END_MS / 1000 - SPAN_S + 60 )) END_S=$(( END_MS / 1000 ))
prom() { curl -fsS "http://127.0.0.1:37401/api/v1/$1" --data-urlencode "query=$2" "${@:3}"; }
AGG='sum by (rack) (avg_over_time(DCGM_FI_DEV_POWER_USAGE[1m]))'
b0=$(flight_bytes)
prom query_range "$AGG" -d start="$START_S" -d end="$END_S" -d step=60 > "$WORK/agg.json"
b1=$(flight_bytes)
prom query_range 'DCGM_FI_DEV_POWER_USAGE' -d start="$START_S" -d end="$END_S" -d step=60 > /dev/null
b2=$(flight_bytes)
# At steps under 10 s a selector is not pushed down: its raw samples travel.
prom query_range 'DCGM_FI_DEV_POWER_USAGE' -d start="$START_S" -d end="$END_S" -d step=5 > /dev/null
b2r=$(flight_bytes)
# Every raw sample the aggregation's windows cover, cluster-wide.
COVERED=$(prom query "sum(count_over_time(DCGM_FI_DEV_POWER_USAGE[$(( SPAN_S ))s]))" -d time="$END_S" \
  | python3 -c 'import json, sys; print(int(float(json.load(sys.stdin)["data"]["result"][0]["value"][1])))')
python3 - "$((b1 - b0))" "$((b2r - b2))" "$COVERED" "$AGG" "$((b2 - b1))" <<'PY' | tee "$OUT/bytes.txt"
import sys
pushed, raw, covered, q = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
series = int(sys.argv[5])
print(f"{q}, range over the span at 60 s steps:")
print(f"  pushed down: {pushed:,} bytes from peers; raw samples covered: {covered:,} ({covered * 16:,} bytes at 16 B/sample)")
print(f"  = {100 * pushed / (covered * 16):.3f} % of the raw samples' bytes (goal <= 1 %)")
print(f"  the selector alone at 60 s steps (pushed down, a point per series and step): {series:,} bytes from peers")
print(f"  the selector at 5 s steps (read raw: not pushed down under 10 s): {raw:,} bytes from peers")
PY

say "bytes between nodes: a SQL aggregate pushed down, and the same rows read raw"
sql() { curl -fsS "http://127.0.0.1:37401/api/v1/sql" --data-binary "$1"; }
SQL_WHERE="FROM samples WHERE metric = 'DCGM_FI_DEV_POWER_USAGE'"
SQL_AGG="SELECT rack, count(*), avg(value) $SQL_WHERE GROUP BY rack"
b3=$(flight_bytes)
sql "$SQL_AGG" > "$WORK/sql_agg.json"
b4=$(flight_bytes)
# median() is not pushed down: the same rows travel raw.
sql "SELECT rack, median(value) $SQL_WHERE GROUP BY rack" > /dev/null
b5=$(flight_bytes)
SQL_COVERED=$(sql "SELECT count(*) AS n $SQL_WHERE" \
  | python3 -c 'import json, sys; d = json.load(sys.stdin); r = d["rows"][0] if "rows" in d else d[0]; print(int(r["n"] if isinstance(r, dict) else r[0]))')
python3 - "$((b4 - b3))" "$((b5 - b4))" "$SQL_COVERED" "$SQL_AGG" <<'PY' | tee -a "$OUT/bytes.txt"
import sys
pushed, raw, covered, q = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
print(f"{q}:")
print(f"  pushed down: {pushed:,} bytes from peers; raw samples covered: {covered:,} ({covered * 16:,} bytes at 16 B/sample)")
print(f"  = {100 * pushed / (covered * 16):.4f} % of the raw samples' bytes (goal <= 1 %)")
print(f"  median(value) instead (not pushed down): {raw:,} bytes from peers")
PY

say "cluster status"
"$BIN" cluster status --cluster "$FILE"

if [ "${SINGLE:-1}" = 1 ]; then
  # The same fleet in one node, for the cluster-vs-one-node ratio (goal
  # within 1.5x). The cluster is stopped first: the single node gets the VM.
  for p in "${NODE_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${NODE_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  say "one node with the same fleet, the same query set"
  "$BIN" serve --data-dir "$WORK/single" --grpc-listen 127.0.0.1:27400 \
    --http-listen 127.0.0.1:27401 --pg-listen off --flush-interval 2m > "$WORK/single.log" 2>&1 &
  PIDS+=("$!")
  for _ in $(seq 600); do
    curl -fsS -o /dev/null http://127.0.0.1:27401/api/v1/status/buildinfo 2>/dev/null && break
    sleep 0.1
  done
  "$BENCH" ingest --url http://127.0.0.1:27400 --gpus "$GPUS" --interval 1s --span "$SPAN" \
    --end-ms "$END_MS" --json "$OUT/single-ingest.jsonl" > /dev/null
  "$BENCH" query --url http://127.0.0.1:27401 --sql --at-ms "$END_MS" --reps "$REPS" \
    --system gpulse-single --json "$OUT/single-query.jsonl"
  python3 - "$OUT/query.jsonl" "$OUT/single-query.jsonl" <<'PY' | tee "$OUT/ratio.txt"
import json, sys
def p50(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if r.get("p50_ms") is not None:
            out[(r["query"], r["language"])] = r["p50_ms"]
    return out
cluster, single = p50(sys.argv[1]), p50(sys.argv[2])
print("| query | language | one node p50 (ms) | cluster p50 (ms) | ratio |")
print("| --- | --- | --- | --- | --- |")
for k in sorted(single):
    if k in cluster:
        print(f"| `{k[0]}` | {k[1]} | {single[k]:.2f} | {cluster[k]:.2f} | {cluster[k] / single[k]:.2f}x |")
PY
fi
