# The agent's footprint on a GPU host: `AGENT=path/to/gpulse-agent OUT=dir python3 measure.py 1s 30 9411`
# (interval, seconds, metrics port).
# Runs gpulse-agent on the real GPU at an interval for some seconds, reads its
# /metrics and /proc/PID/status (VmHWM: peak RSS; RssAnon / RssFile: heap vs
# mapped files such as libnvidia-ml), stops it with SIGINT, and prints them
# with its CPU time (wait4). Not wait4's ru_maxrss: that counts the Python
# process the agent was forked from.
import os, sys, time, signal, subprocess, urllib.request
interval, secs, port = sys.argv[1], float(sys.argv[2]), sys.argv[3]
log = open(f"{os.environ['OUT']}/agent-{interval}.log", "w")
p = subprocess.Popen([os.environ.get("AGENT", "./gpulse-agent"), "--ingest", os.environ.get("INGEST", "grpc://127.0.0.1:9"), "--no-spool",
    "--interval", interval, "--metrics-listen", f"127.0.0.1:{port}", "--drain-timeout", "1s",
    "--host", "h200-live"], stdout=log, stderr=log)
time.sleep(secs)
m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
st = {l.split(":")[0]: l.split(":")[1].strip() for l in open(f"/proc/{p.pid}/status")}
maps = []
for block in open(f"/proc/{p.pid}/smaps").read().split("\n"):
    f = block.split()
    if f and "-" in f[0] and len(f) >= 5:
        name = f[5] if len(f) > 5 else "[anon]"
    elif f and f[0] == "Rss:" and int(f[1]) > 0:
        maps.append((int(f[1]), name))
agg = {}
for kib, name in maps:
    agg[name] = agg.get(name, 0) + kib
top = sorted(agg.items(), key=lambda x: -x[1])[:8]
p.send_signal(signal.SIGINT)
_, status, ru = os.wait4(p.pid, 0)
vals = {l.split()[0]: float(l.split()[1]) for l in m.splitlines() if l and not l.startswith("#") and "{" not in l}
polls = vals["gpulse_agent_polls_total"]
print(f"interval={interval} secs={secs} status={status} polls={polls:.0f} samples={vals['gpulse_agent_samples_total']:.0f} "
      f"poll_ms_mean={1000 * vals['gpulse_agent_poll_duration_seconds_total'] / polls:.3f} "
      f"nvml_errors={vals['gpulse_agent_nvml_errors_total']:.0f} VmHWM={st['VmHWM']} RssAnon={st['RssAnon']} RssFile={st['RssFile']} "
      f"cpu_s={ru.ru_utime + ru.ru_stime:.3f} cpu_pct={100 * (ru.ru_utime + ru.ru_stime) / secs:.2f}", flush=True)
print("  largest mappings (Rss KiB):", ", ".join(f"{n.split('/')[-1]} {k}" for n, k in top), flush=True)
