# The agent's footprint on a GPU host: `AGENT=path/to/gpulse-agent OUT=dir python3 measure.py 1s 30 9411`
# (interval, seconds, metrics port).
# Runs gpulse-agent on the real GPU at an interval for some seconds, reads its
# /metrics, stops it with SIGINT, and prints peak RSS and CPU time (wait4).
import os, sys, time, signal, subprocess, urllib.request
interval, secs, port = sys.argv[1], float(sys.argv[2]), sys.argv[3]
log = open(f"{os.environ['OUT']}/agent-{interval}.log", "w")
p = subprocess.Popen([os.environ.get("AGENT", "./gpulse-agent"), "--ingest", "grpc://127.0.0.1:9", "--no-spool",
    "--interval", interval, "--metrics-listen", f"127.0.0.1:{port}", "--drain-timeout", "1s",
    "--host", "h200-live"], stdout=log, stderr=log)
time.sleep(secs)
m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
p.send_signal(signal.SIGINT)
_, status, ru = os.wait4(p.pid, 0)
vals = {l.split()[0]: float(l.split()[1]) for l in m.splitlines() if l and not l.startswith("#") and "{" not in l}
polls = vals["gpulse_agent_polls_total"]
print(f"interval={interval} secs={secs} status={status} polls={polls:.0f} samples={vals['gpulse_agent_samples_total']:.0f} "
      f"poll_ms_mean={1000 * vals['gpulse_agent_poll_duration_seconds_total'] / polls:.3f} "
      f"nvml_errors={vals['gpulse_agent_nvml_errors_total']:.0f} peak_rss_kib={ru.ru_maxrss} "
      f"cpu_s={ru.ru_utime + ru.ru_stime:.3f} cpu_pct={100 * (ru.ru_utime + ru.ru_stime) / secs:.2f}", flush=True)
