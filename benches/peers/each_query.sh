#!/usr/bin/env bash
# Each query of the set alone against one running server, and each panel of
# the dashboard apart: the median wall time of N runs by curl, and the
# server's own CPU time per query (utime + stime of its /proc entry, in clock
# ticks, so N=20 resolves 0.5 ms). For A/B runs of one change on a noisy
# machine, where the peers run's single p50 moves with the load:
#
#   benches/peers/each_query.sh URL PID END_MS
#
# URL: the Prometheus-compatible base URL (gpulse's HTTP listener, or
# VictoriaMetrics); PID: that server's process; END_MS: the end of the loaded
# data in Unix ms (what `gpulse-bench ingest --end-ms` got). N (default 20).
# Load a server as benches/peers/run.sh does, e.g.:
#   gpulse serve --data-dir D --grpc-listen 127.0.0.1:17400 --http-listen 127.0.0.1:17401 --pg-listen off &
#   gpulse-bench ingest --protocol agent --url grpc://127.0.0.1:17400 --gpus 1000 --span 2h \
#     --interval 10s --end-ms $END_MS --flush-url http://127.0.0.1:17401/api/v1/admin/flush
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 URL PID END_MS" >&2; exit 2; }
URL=$1 PID=$2 E=$3 N=${N:-20}
S=$(( (E - 6 * 3600000) / 60000 * 60 )) EN=$(( E / 60000 * 60 ))
S30=$(( (E - 30 * 86400000) / 3600000 * 3600 )) E30=$(( E / 3600000 * 3600 ))
T="$(( E / 1000 )).$(printf '%03d' $(( E % 1000 )))"
sel='{instance=~".*", gpu=~".*"}'
cpu() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
tick=$(getconf CLK_TCK)
run() { # NAME CURL-ARGS...
  local name=$1; shift
  curl -fsS -o /dev/null "$@"
  local c0 c1 wall
  c0=$(cpu)
  wall=$(for _ in $(seq "$N"); do curl -fsS -o /dev/null -w '%{time_total}\n' "$@"; done |
    sort -n | awk '{a[NR] = $1} END {printf "%.2f", a[int((NR + 1) / 2)] * 1000}')
  c1=$(cpu)
  printf '%-22s wall p50 %8s ms   server CPU %7.2f ms/query\n' "$name" "$wall" \
    "$(echo "($c1 - $c0) * 1000 / $tick / $N" | bc -l)"
}
range() { run "$1" --data-urlencode "query=$2" --data-urlencode "start=$3" --data-urlencode "end=$4" \
  --data-urlencode "step=$5" "$URL/api/v1/query_range?nocache=1"; }
instant() { run "$1" --data-urlencode "query=$2" --data-urlencode "time=$T" "$URL/api/v1/query?nocache=1"; }
# The panels of dashboard_6h (benches/gpulse-bench/src/queries.rs).
range panel_temp "DCGM_FI_DEV_GPU_TEMP$sel" "$S" "$EN" 60
range panel_avg_temp "avg(DCGM_FI_DEV_GPU_TEMP$sel)" "$S" "$EN" 60
range panel_power "DCGM_FI_DEV_POWER_USAGE$sel" "$S" "$EN" 60
instant panel_power_total "sum(DCGM_FI_DEV_POWER_USAGE$sel)"
range panel_sm_clock "DCGM_FI_DEV_SM_CLOCK$sel * 1000000" "$S" "$EN" 60
range panel_util "DCGM_FI_DEV_GPU_UTIL$sel" "$S" "$EN" 60
range panel_fb_used "DCGM_FI_DEV_FB_USED$sel" "$S" "$EN" 60
range panel_tensor "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE$sel" "$S" "$EN" 60
# The rest of the query set.
instant gpu_last_hour '{Hostname="host-00000",gpu="0"}[1h]'
instant rack_util_1h 'avg by (rack) (avg_over_time(DCGM_FI_DEV_GPU_UTIL[1h]))'
instant top10_hottest 'topk(10, DCGM_FI_DEV_GPU_TEMP)'
range host_energy_rate_6h 'sum by (Hostname) (rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[5m]))' "$S" "$EN" 60
range rack_power_30d 'avg(avg_over_time(DCGM_FI_DEV_POWER_USAGE{rack="rack-000"}[1h]))' "$S30" "$E30" 3600
