# Part of benches/live/record.sh (see there).
# GPU load in phases for the recorded trace; writes phase,start_ms,end_ms.
import sys, time, torch
out = open(sys.argv[1], "w")
out.write("phase,start_ms,end_ms\n")
ms = lambda: int(time.time() * 1000)
def phase(name, secs, body=None):
    t0 = ms(); end = time.time() + secs
    while time.time() < end:
        if body: body()
        else: time.sleep(0.05)
    torch.cuda.synchronize()
    out.write(f"{name},{t0},{ms()}\n"); out.flush()
dev = torch.device("cuda")
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
src = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
dst = torch.empty_like(src)
torch.cuda.synchronize()
def mm():
    for _ in range(20): torch.mm(a, b)
    torch.cuda.synchronize()
def cp():
    for _ in range(10): dst.copy_(src)
    torch.cuda.synchronize()
phase("idle", 15)
phase("matmul_bf16", 35, mm)
phase("hbm_copy", 20, cp)
big = torch.empty(100 << 30, dtype=torch.uint8, device=dev)
big.fill_(1); torch.cuda.synchronize()
phase("hold_100gib", 15)
del big, src, dst, a, b
torch.cuda.empty_cache()
phase("idle_after", 15)
