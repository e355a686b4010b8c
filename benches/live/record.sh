#!/bin/bash
# Records tests/data/h200 on a GPU host: the live NVML tests, then
# gpulse-agent sampling the GPU at 1 Hz for 108 polls while load.py runs
# idle / bf16 matmul / HBM copy / 100 GiB held / idle, with nvidia-smi read
# every second beside it (smi.py) as an independent account of the same GPU.
#
#   AGENT_TEST=path/to/agent-test-binary AGENT=path/to/gpulse-agent OUT=dir benches/live/record.sh
#
# AGENT_TEST: `cargo test -p agent --features nvml-live --no-run` prints it.
# Needs python3 with torch (load.py). The agent is pointed at an address
# where nothing listens: the record holds every sample it produced either way.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$OUT"
nvidia-smi -q > "$OUT/smi-q.txt" 2>&1
timeout 120 "$AGENT_TEST" --ignored --nocapture --test-threads 1 live_ 2>&1 | tee "$OUT/live-tests.log"
python3 "$here/smi.py" "$OUT/nvidia-smi.csv" 112 &
smi=$!
python3 "$here/load.py" "$OUT/phases.csv" > "$OUT/load.log" 2>&1 &
load=$!
# The agent runs until its polls are acked, which never happens here: stop it
# with SIGINT once the polls are done (it then waits --drain-timeout).
"$AGENT" --ingest grpc://127.0.0.1:9 --no-spool --polls 108 --interval 1s \
  --record "$OUT/trace.csv" --metrics-listen off --drain-timeout 1s \
  --host h200-live --agent-id h200-live > "$OUT/agent.log" 2>&1 &
agent=$!
sleep 112
kill -INT "$agent"
wait "$agent" "$smi" "$load"
zstd -19 -q -f "$OUT/trace.csv" -o "$OUT/trace.csv.zst"
