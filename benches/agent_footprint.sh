#!/usr/bin/env bash
# Agent footprint: CPU (% of one core) and RSS of `gpulse-agent` on a simulated
# node of 8 GPUs x all fields, streaming to a local `gpulse serve`, at 1 s and
# at 100 ms sampling. Targets at 1 s: CPU <= 0.5 % (issue #4), peak RSS
# <= 12 MiB (issue #15).
#
#   cargo build --release && benches/agent_footprint.sh [SECONDS]
#
# GPULSE_BIN is the serve binary (default target/release/gpulse), AGENT_BIN
# the agent (default target/release/gpulse-agent; `gpulse` itself measures
# `gpulse agent`, the agent inside the node binary).
#
# CPU is utime + stime of the agent process from /proc/PID/stat over the
# measuring window (after a 5 s warm-up), divided by the window's wall time.
# RSS is VmRSS at the end and VmHWM (the peak) from /proc/PID/status.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
bin="${GPULSE_BIN:-target/release/gpulse}"
agent_bin="${AGENT_BIN:-target/release/gpulse-agent}"
for b in "$bin" "$agent_bin"; do
  [[ -x "$b" ]] || { echo "build first: cargo build --release ($b missing)" >&2; exit 1; }
done
agent_cmd=("$agent_bin")
[[ "$(basename "$agent_bin")" == gpulse ]] && agent_cmd+=(agent)
tmp="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"' EXIT
hz="$(getconf CLK_TCK)"

"$bin" serve --data-dir "$tmp/data" --grpc-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
  >"$tmp/serve.out" 2>"$tmp/serve.log" &
for _ in $(seq 100); do grep -q "gpulse ready" "$tmp/serve.out" && break; sleep 0.1; done
grpc="$(grep -o 'grpc://[0-9.:]*' "$tmp/serve.out" | head -1)"

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
status_kib() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status"; }

printf '| interval | GPUs | samples/s | agent CPU (%% of one core) | RSS end (MiB) | RSS peak (MiB) |\n'
printf '| --- | --- | --- | --- | --- | --- |\n'
for interval in 1s 100ms; do
  "${agent_cmd[@]}" --simulate --gpus 8 --interval "$interval" --ingest "$grpc" \
    --spool-dir "$tmp/spool-$interval" --metrics-listen 127.0.0.1:0 \
    >"$tmp/agent-$interval.out" 2>"$tmp/agent-$interval.log" &
  pid=$!
  sleep 5
  t0="$(cpu_ticks "$pid")"; w0="$(date +%s.%N)"
  murl="$(grep -o 'http://[0-9.:]*/metrics' "$tmp/agent-$interval.out" | head -1)"
  s0="$(curl -s "$murl" | awk '$1 == "gpulse_agent_samples_acked_total" {print $2}')"
  sleep "$secs"
  t1="$(cpu_ticks "$pid")"; w1="$(date +%s.%N)"
  s1="$(curl -s "$murl" | awk '$1 == "gpulse_agent_samples_acked_total" {print $2}')"
  rss="$(status_kib "$pid" VmRSS)"; hwm="$(status_kib "$pid" VmHWM)"
  kill -TERM "$pid"; wait "$pid" || true
  awk -v iv="$interval" -v t0="$t0" -v t1="$t1" -v w0="$w0" -v w1="$w1" -v hz="$hz" \
      -v s0="$s0" -v s1="$s1" -v rss="$rss" -v hwm="$hwm" 'BEGIN {
    wall = w1 - w0
    printf "| %s | 8 | %.0f | %.2f | %.1f | %.1f |\n", iv, (s1 - s0) / wall,
      100 * (t1 - t0) / hz / wall, rss / 1024, hwm / 1024
  }'
done
