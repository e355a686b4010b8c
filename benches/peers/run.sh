#!/usr/bin/env bash
# gpulse against VictoriaMetrics and Prometheus, on the same machine, the same
# data and in the same run (issue #7). From nothing installed to a finished
# table:
#
#   benches/peers/run.sh            # the full run (docs/BENCHMARKS.md + charts)
#   benches/peers/run.sh --quick    # a smoke run (CI): tiny data, report in target/peers
#
# What it does, for each system in turn, each on 127.0.0.1 over a fresh
# temporary data directory:
#   1. installs Debian's victoria-metrics and prometheus (and curl, python3,
#      fonts-dejavu-core) if they are missing;
#   2. builds gpulse and gpulse-bench (`--release`: gpulse's own crates and
#      the hot paths' dependencies optimised, SQL planning and the rest not,
#      see the root Cargo.toml; the debug build for --quick), unless GPULSE_BIN names a binary (gpulse-bench is then the
#      one beside it, or BENCH_BIN);
#   3. loads the simulated fleet, then (into a fresh instance) the real DCGM
#      recordings of ../shared/data/real, with `gpulse-bench ingest`: the
#      peers by Prometheus remote-write, gpulse by remote-write and by its
#      agent protocol. CPU and RSS come from the server's /proc entries;
#   4. makes each system flush and merge in its own way (gpulse
#      /api/v1/admin/flush; VictoriaMetrics /internal/force_flush and
#      /internal/force_merge; Prometheus a TSDB snapshot with its head) and
#      measures its data directory;
#   5. times the query set with `gpulse-bench query` (PromQL on all three,
#      SQL raw and over rollups on gpulse);
#   6. `gpulse-bench report` prints the table of ratios and writes the
#      docs/BENCHMARKS.md section and the PNG charts (full run only).
#
# Settings (environment): GPUS (default 1000), SPAN (2h), INTERVAL (10s),
# REPS (20), GPULSE_BIN, BENCH_BIN, OUT (results directory, default target/peers).
set -euo pipefail

QUICK=0
case "${1:-}" in
  --quick) QUICK=1 ;;
  "") ;;
  *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
REAL_DIR=$(cd "$ROOT/.." && pwd)/shared/data/real
OUT=${OUT:-$ROOT/target/peers}
WORK=$(mktemp -d /tmp/gpulse-peers.XXXXXX)
PIDS=()
START_S=$(date +%s)

cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

say() { printf '\n== %s (%ds)\n' "$*" $(( $(date +%s) - START_S )); }

# --- 1. install ------------------------------------------------------------
say "installing what is missing"
need=()
command -v victoria-metrics >/dev/null || need+=(victoria-metrics)
command -v prometheus >/dev/null || need+=(prometheus)
command -v curl >/dev/null || need+=(curl ca-certificates)
command -v python3 >/dev/null || need+=(python3)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
if ((${#need[@]})); then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
VM_VERSION="victoria-metrics $(dpkg-query -W -f='${Version}' victoria-metrics 2>/dev/null || echo '(version unknown)')"
PROM_VERSION="prometheus $(dpkg-query -W -f='${Version}' prometheus 2>/dev/null || echo '(version unknown)')"

# --- 2. gpulse -------------------------------------------------------------
if [ -n "${GPULSE_BIN:-}" ]; then
  BIN=$GPULSE_BIN
  BENCH=${BENCH_BIN:-$(dirname "$BIN")/gpulse-bench}
elif ((QUICK)); then
  say "building gpulse and gpulse-bench (debug)"
  (cd "$ROOT" && cargo build --bin gpulse --bin gpulse-bench)
  BIN=$ROOT/target/debug/gpulse
  BENCH=$ROOT/target/debug/gpulse-bench
else
  say "building gpulse and gpulse-bench (--release)"
  (cd "$ROOT" && cargo build --release --bin gpulse --bin gpulse-bench)
  BIN=$ROOT/target/release/gpulse
  BENCH=$ROOT/target/release/gpulse-bench
fi
[ -x "$BENCH" ] || { echo "no gpulse-bench binary at $BENCH (cargo build -p gpulse-bench, or set BENCH_BIN)" >&2; exit 2; }

if ((QUICK)); then
  GPUS=${GPUS:-64} SPAN=${SPAN:-30m} INTERVAL=${INTERVAL:-10s} REPS=${REPS:-3}
else
  GPUS=${GPUS:-1000} SPAN=${SPAN:-2h} INTERVAL=${INTERVAL:-10s} REPS=${REPS:-20}
fi
mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl
: > "$RESULTS"
END_MS=$(( $(date +%s) * 1000 ))
SIM=(--gpus "$GPUS" --span "$SPAN" --interval "$INTERVAL" --end-ms "$END_MS")

REAL=()
if [ -f "$REAL_DIR/to_long_csv.py" ]; then
  say "converting the real recordings"
  if ((QUICK)); then
    python3 "$REAL_DIR/to_long_csv.py" ath_b1 > "$WORK/real.csv"
  else
    python3 "$REAL_DIR/to_long_csv.py" > "$WORK/real.csv"
  fi
  REAL=(--recorded "$WORK/real.csv" --end-ms "$END_MS")
else
  echo "no $REAL_DIR: the recorded-data rows are skipped" >&2
fi

# --- servers ---------------------------------------------------------------
wait_http() { # URL: up to 60 s
  for _ in $(seq 600); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "no answer from $1" >&2
  return 1
}

stop() { # PID
  kill -TERM "$1" 2>/dev/null || true
  for _ in $(seq 300); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$1" 2>/dev/null || true
}

# A server left on one of these ports by another run would answer in place
# of the one started here, and its data would be measured: refuse to start.
port_free() { # HOST:PORT ...
  local a
  for a in "$@"; do
    if (exec 3<>"/dev/tcp/${a%:*}/${a##*:}") 2>/dev/null; then
      echo "something already listens on $a (a server of another run?): stop it first" >&2
      exit 2
    fi
  done
}

started() { # PID LOG: the server started here is the one that answered
  kill -0 "$1" 2>/dev/null && return 0
  echo "the server exited at start; the end of $2:" >&2
  tail -5 "$2" >&2
  exit 2
}

GP_GRPC=127.0.0.1:17400 GP_HTTP=127.0.0.1:17401
start_gpulse() { # DIR
  port_free "$GP_GRPC" "$GP_HTTP"
  "$BIN" serve --data-dir "$1" --grpc-listen "$GP_GRPC" --http-listen "$GP_HTTP" --pg-listen off \
    > "$1.log" 2>&1 &
  PID=$!; PIDS+=("$PID")
  wait_http "http://$GP_HTTP/api/v1/status/buildinfo"
  started "$PID" "$1.log"
}

VM_HTTP=127.0.0.1:18428
start_vm() { # DIR
  port_free "$VM_HTTP"
  victoria-metrics -storageDataPath="$1" -httpListenAddr="$VM_HTTP" -retentionPeriod=100y \
    -loggerLevel=ERROR > "$1.log" 2>&1 &
  PID=$!; PIDS+=("$PID")
  wait_http "http://$VM_HTTP/health"
  started "$PID" "$1.log"
}

PROM_HTTP=127.0.0.1:19090
start_prometheus() { # DIR
  port_free "$PROM_HTTP"
  printf 'global:\n  scrape_interval: 1h\n' > "$1.yml"
  prometheus --config.file="$1.yml" --storage.tsdb.path="$1" --web.listen-address="$PROM_HTTP" \
    --web.enable-remote-write-receiver --web.enable-admin-api \
    --storage.tsdb.retention.time=100y --log.level=error > "$1.log" 2>&1 &
  PID=$!; PIDS+=("$PID")
  wait_http "http://$PROM_HTTP/-/ready"
  started "$PID" "$1.log"
}

ingest() { # SYSTEM PROTOCOL URL PID DISK FLUSH-ARGS... -- DATA-ARGS...
  local system=$1 protocol=$2 url=$3 pid=$4 disk=$5; shift 5
  "$BENCH" ingest --system "$system" --protocol "$protocol" --url "$url" \
    --server-pid "$pid" --disk-path "$disk" --json "$RESULTS" "$@"
}

# --- 3-5. each system ------------------------------------------------------
run_gpulse() { # PROTOCOL DATASET
  local dir=$WORK/gpulse-$1-$2 url
  start_gpulse "$dir"
  if [ "$1" = agent ]; then url=grpc://$GP_GRPC; else url=http://$GP_HTTP/api/v1/write; fi
  local data=("${SIM[@]}"); [ "$2" = sim ] || data=("${REAL[@]}")
  ingest gpulse "$1" "$url" "$PID" "$dir" --flush-url "http://$GP_HTTP/api/v1/admin/flush" "${data[@]}"
  if [ "$1-$2" = agent-sim ]; then
    "$BENCH" query --url "http://$GP_HTTP" --sql --at-ms "$END_MS" --reps "$REPS" \
      --system gpulse --json "$RESULTS"
  fi
  stop "$PID"
}

run_vm() { # DATASET
  local dir=$WORK/vm-$1
  start_vm "$dir"
  local data=("${SIM[@]}"); [ "$1" = sim ] || data=("${REAL[@]}")
  ingest victoria-metrics remote-write "http://$VM_HTTP/api/v1/write" "$PID" "$dir" \
    --flush-url "http://$VM_HTTP/internal/force_flush" \
    --flush-url "http://$VM_HTTP/internal/force_merge" \
    --settle-metric "http://$VM_HTTP/metrics#vm_active_force_merges" "${data[@]}"
  if [ "$1" = sim ]; then
    "$BENCH" query --url "http://$VM_HTTP" --at-ms "$END_MS" --reps "$REPS" \
      --system victoria-metrics --json "$RESULTS" || echo "(some VictoriaMetrics queries failed; see the report)"
  fi
  stop "$PID"
}

run_prometheus() { # DATASET
  local dir=$WORK/prom-$1
  start_prometheus "$dir"
  local data=("${SIM[@]}"); [ "$1" = sim ] || data=("${REAL[@]}")
  ingest prometheus remote-write "http://$PROM_HTTP/api/v1/write" "$PID" "$dir/snapshots" \
    --flush-url "http://$PROM_HTTP/api/v1/admin/tsdb/snapshot" "${data[@]}"
  if [ "$1" = sim ]; then
    "$BENCH" query --url "http://$PROM_HTTP" --at-ms "$END_MS" --reps "$REPS" \
      --system prometheus --json "$RESULTS" || echo "(some Prometheus queries failed; see the report)"
  fi
  stop "$PID"
}

DATASETS=(sim); ((${#REAL[@]})) && DATASETS+=(real)
for d in "${DATASETS[@]}"; do
  say "gpulse, agent protocol, $d";      run_gpulse agent "$d"
  say "gpulse, remote-write, $d";        run_gpulse remote-write "$d"
  say "VictoriaMetrics, remote-write, $d"; run_vm "$d"
  say "Prometheus, remote-write, $d";    run_prometheus "$d"
done

# --- 6. report -------------------------------------------------------------
say "report"
ELAPSED=$(( $(date +%s) - START_S ))
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
# A tree changed outside docs/ (which this script writes) is not that commit.
git -C "$ROOT" diff --quiet HEAD -- . ':!docs' 2>/dev/null || COMMIT="$COMMIT, with uncommitted changes"
if [ -n "${GPULSE_BIN:-}" ]; then
  COMMAND="GPULSE_BIN=$GPULSE_BIN benches/peers/run.sh\` ($ELAPSED s, the build not included)"
else
  COMMAND="benches/peers/run.sh\` ($ELAPSED s, build included)"
fi
NOTE="Run $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), \
$(( $(grep MemTotal /proc/meminfo | awk '{print $2}') / 1048576 )) GiB; gpulse $("$BIN" --version | cut -d' ' -f2) \
(commit \`$COMMIT\`), ${VM_VERSION} and ${PROM_VERSION} (Debian packages). \
Data: simulated fleet of $GPUS GPUs, $SPAN at $INTERVAL (53 DCGM fields per GPU), and the real DCGM recordings. \
Command: \`$COMMAND. Client and server share the machine's cores; \
per-core figures divide by the server's own CPU time. Unless GPULSE_BIN named another binary, gpulse is the \
release build: SQL planning is unoptimised there (root Cargo.toml), the operators and Arrow's kernels are not."
if ((QUICK)); then
  "$BENCH" report "$RESULTS" --markdown "$OUT/report.md" --charts "$OUT/charts" --note "$NOTE"
else
  "$BENCH" report "$RESULTS" --markdown "$ROOT/docs/BENCHMARKS.md" --charts "$ROOT/docs/bench" \
    --charts-link bench --note "$NOTE"
fi
say "done"
