#!/usr/bin/env bash
# Runs every fuzz target of fuzz/Cargo.toml for SECONDS of CPU time each
# (default 600), one after the other, and prints per target: runs, execs/s,
# coverage, CPU seconds and new crashes. Exits non-zero if any target crashed
# (or failed to build or run).
#
#   fuzz/run.sh [SECONDS] [TARGET...]
#
# SECONDS is CPU time (user + system of the fuzzer process, all its threads),
# not wall time, so that a run on a loaded machine still fuzzes as long as
# it says; a target is also stopped at 3 x SECONDS + 60 of wall time.
#
# Corpus: fuzz/corpus/<target> (kept between runs, not in git), seeded from
# fuzz/seeds/<target> (in git) when that exists; fuzz/dict/<target>.dict is
# passed as a libFuzzer dictionary when it exists. Crashes land in
# fuzz/artifacts/<target>/ (crash-*, oom-*, timeout-*); reproduce one with
#   cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run $FUZZ_BUILD <target> artifacts/<target>/<file>
#
# Environment:
#   FUZZ_BUILD   cargo-fuzz build flags (default: "-O -a -s none --codegen-units 16";
#                fuzz/README.md says why)
#   FUZZ_ARGS    extra libFuzzer flags for every target
# Works on the stable toolchain (RUSTC_BOOTSTRAP=1: cargo-fuzz needs -Z flags).
set -euo pipefail
cd "$(dirname "$0")"
export RUSTC_BOOTSTRAP=1
seconds=${1:-600}
shift || true
build=${FUZZ_BUILD:--O -a -s none --codegen-units 16}
read -r -a build_flags <<<"$build"
read -r -a extra <<<"${FUZZ_ARGS:-}"

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "cargo-fuzz is not installed: cargo install cargo-fuzz --locked" >&2
  exit 2
fi
# fuzz/ is its own workspace; start from the workspace's lock file so that it
# builds the same versions of shared dependencies as the node.
[[ -f Cargo.lock ]] || cp ../Cargo.lock Cargo.lock

if (($#)); then
  targets=("$@")
else
  mapfile -t targets < <(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^gpulse-fuzz$')
fi

mkdir -p logs
start=$(date +%s)
if ! cargo fuzz build "${build_flags[@]}" >logs/build.log 2>&1; then
  tail -n 40 logs/build.log >&2
  echo "the fuzz targets did not build (fuzz/logs/build.log)" >&2
  exit 2
fi
echo "build ($build): $(($(date +%s) - start)) s"
profile=release
[[ " $build " == *" --dev "* || " $build " == *" -D "* ]] && profile=debug
bindir=target/$(rustc -vV | sed -n 's/^host: //p')/$profile
tick=$(getconf CLK_TCK)

# CPU seconds (user + system, all threads) of a live process.
cpu_of() {
  awk -v tick="$tick" '{ print int(($14 + $15) / tick) }' "/proc/$1/stat" 2>/dev/null || echo 0
}

failed=0
printf '%-18s %10s %9s %8s %8s %8s %s\n' target runs execs/s cov ft cpu_s crashes
for t in "${targets[@]}"; do
  corpus=corpus/$t
  artifacts=artifacts/$t
  mkdir -p "$corpus" "$artifacts"
  dirs=("$corpus")
  [[ -d seeds/$t ]] && dirs+=("seeds/$t")
  dict=()
  [[ -f dict/$t.dict ]] && dict=("-dict=dict/$t.dict")
  before=$(find "$artifacts" -type f | wc -l)
  log=logs/$t.log
  # -timeout: one input running 30 s is a hang (the targets bound their own
  # work far below that). -rss_limit_mb: 2 GiB, libFuzzer's default, stated.
  # -max_total_time is only the wall-time backstop; the CPU budget below
  # ends the run with SIGUSR1, libFuzzer's graceful exit (a flag its loop
  # checks, then its final stats and status 0). Not SIGINT: libFuzzer's
  # SIGINT handler allocates, and a SIGINT that lands inside malloc
  # deadlocks the fuzzer for good (seen once, in storage_ops).
  "$bindir/$t" -artifact_prefix="$artifacts/" \
    -max_total_time=$((3 * seconds + 60)) -timeout=30 -rss_limit_mb=2048 -max_len=4096 \
    -print_final_stats=1 "${dict[@]}" "${extra[@]}" \
    "${dirs[@]}" >"$log" 2>&1 &
  pid=$!
  cpu=0
  stopped=0
  while kill -0 "$pid" 2>/dev/null; do
    cpu=$(cpu_of "$pid")
    if ((cpu >= seconds)); then
      kill -USR1 "$pid" 2>/dev/null || true
      stopped=1
      break
    fi
    sleep 1
  done
  # Backstop: a fuzzer that has not exited 60 s after the signal is killed,
  # and its run reported as such.
  killed=0
  if ((stopped)); then
    for _ in $(seq 60); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 1
    done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null || true
      killed=1
    fi
  fi
  rc=0
  wait "$pid" || rc=$?
  # (A killed fuzzer's status, 137, fails the run below.)
  if ((killed)); then
    echo "fuzz: $t did not exit 60 s after its budget's signal; killed (see $log)" >&2
  fi
  after=$(find "$artifacts" -type f | wc -l)
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
  new=$((after - before))
  printf '%-18s %10s %9s %8s %8s %8s %s\n' "$t" "${runs:-?}" "${eps:-?}" "${cov:-?}" "${ft:-?}" "$cpu" "$new"
  if ((rc != 0 || new > 0)); then
    failed=1
    echo "  $t: exit $rc, $new new artifact(s) in fuzz/$artifacts; the end of fuzz/$log:" >&2
    grep -E 'panicked|ERROR|SUMMARY|Test unit written|deadly signal' "$log" | head -n 8 | sed 's/^/    /' >&2 || true
  fi
done
exit "$failed"
