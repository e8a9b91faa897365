import cProfile, pstats, time, torch, os
from kvdoctor.probe.ledger import slots as L
led = L.SlotLedger(name="t", size=65536, page_size=1, device="cuda", emit=lambda n, a: None, requests=L.RequestTable(), sites=L.CallSites())
idx = torch.arange(1, 33, device="cuda")
for _ in range(50):
    led.on_alloc(idx, 1, only_page_starts=False); led.on_free(idx, 1, evicting=False)
torch.cuda.synchronize()
k = led.kernels
def loop(n=2000):
    for _ in range(n):
        led.on_alloc(idx, 1, only_page_starts=False); led.on_free(idx, 1, evicting=False)
t0=time.perf_counter(); loop(); t=time.perf_counter()-t0; torch.cuda.synchronize(); print("us per call", t/4000*1e6)
# components
ck = next(iter(k.check_launch.compiled.values()))
n=4000
t0=time.perf_counter()
for _ in range(n): led.xp.index(idx)
print("xp.index us", (time.perf_counter()-t0)/n*1e6)
s = torch._C._cuda_getCurrentRawStream
t0=time.perf_counter()
for _ in range(n): s(0)
print("stream us", (time.perf_counter()-t0)/n*1e6)
t0=time.perf_counter()
for _ in range(n): ck.launch_metadata((1,1,1), 0, 1, 2)
print("launch_metadata us", (time.perf_counter()-t0)/n*1e6)
args = (idx, 32, led.state, led.owner, led.alloc_site, *k.sizes, 1)
wk = next(iter(k.write_launch.compiled.items()))
key, wck = wk
consts = dict(zip(["OP","PAGE_STARTS","AS_PAGES","EVICTING","BLOCK"], key[:5]))
everything = (*args, *consts.values())
t0=time.perf_counter()
for _ in range(n): wck.run(1,1,1, s(0), wck.function, wck.packed_metadata, None, None, None, *everything)
torch.cuda.synchronize()
print("raw launcher us", (time.perf_counter()-t0)/n*1e6)
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable(); loop(1000); pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
