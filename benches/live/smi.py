# Part of benches/live/record.sh (see there).
# nvidia-smi every second, stamped with the epoch ms at the call; stops at argv[2] seconds.
import sys, time, subprocess
full = "power.draw,power.draw.instant,temperature.gpu,temperature.memory,clocks.sm,clocks.mem,utilization.gpu,utilization.memory,memory.used,memory.free,memory.reserved,memory.total,pstate,clocks_event_reasons.active"
basic = "power.draw,temperature.gpu,clocks.sm,clocks.mem,utilization.gpu,utilization.memory,memory.used,memory.free,memory.total,pstate"
fields = full
if subprocess.run(["nvidia-smi", f"--query-gpu={full}", "--format=csv,noheader,nounits"], capture_output=True).returncode != 0:
    fields = basic
out = open(sys.argv[1], "w")
out.write("timestamp_ms," + fields + "\n")
end = time.time() + float(sys.argv[2])
while time.time() < end:
    t = int(time.time() * 1000)
    r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        out.write(f"{t},{','.join(x.strip() for x in line.split(','))}\n")
    out.flush()
    time.sleep(max(0, 1 - (time.time() - t / 1000)))
