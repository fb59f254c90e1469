import time, sys, os
sys.path.insert(0, os.getcwd())
import torch
from fx_fusion.kernels.ops import fused_norm_rope_stacked
from fx_fusion.kernels.fused_kv_materialize import launch_fused_kv_materialize
T,L,H,D=1,5,8,128
dev="cuda"
kv=torch.randn(T,L,2*H*D,dtype=torch.bfloat16,device=dev); w=torch.randn(L,D,dtype=torch.bfloat16,device=dev); eps=torch.full((L,),1e-6,device=dev)
cache=torch.randn(100,D,device=dev); pos=torch.randint(0,100,(T,),device=dev)
kp, vp = kv[..., :H*D], kv[..., H*D:]
ko=torch.empty(L,T,H,D,dtype=kv.dtype,device=dev); vo=torch.empty_like(ko)
def bench(name, f, n=3000):
    for _ in range(200): f()
    torch.cuda.synchronize()
    t=time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize()
    print(f"{name:30s} {(time.perf_counter()-t)/n*1e6:8.1f} us/call")
bench("empty launch (torch add)", lambda: torch.add(ko, 1, out=vo))
bench("launch direct", lambda: launch_fused_kv_materialize(kp,vp,w,eps,0.0,cache,None,pos,ko,vo,H,D,D,False))
bench("op materialize_kv_out", lambda: torch.ops.fx_fusion.materialize_kv_out(kp,[w],eps,0.0,cache,None,pos,H,D,D,False,vp,ko,vo))
bench("op materialize_kv", lambda: torch.ops.fx_fusion.materialize_kv(kp,[w],eps,0.0,cache,None,pos,H,D,D,False,vp))
bench("drop-in nocheck", lambda: fused_norm_rope_stacked(kv,w,eps,cache,pos,H,D,D,check_positions=False))
bench("drop-in check", lambda: fused_norm_rope_stacked(kv,w,eps,cache,pos,H,D,D))
import triton.testing
def graph_us(fn):
    s=torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s): fn()
    torch.cuda.current_stream().wait_stream(s)
    g=torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    return triton.testing.do_bench(g.replay, return_mode="median")*1e3
for T in (8192, 32768):
    kv=torch.randn(T,L,2*H*D,dtype=torch.bfloat16,device=dev); pos=torch.randint(0,100,(T,),device=dev)
    kp, vp = kv[..., :H*D], kv[..., H*D:]
    ko=torch.empty(L,T,H,D,dtype=kv.dtype,device=dev); vo=torch.empty_like(ko)
    cos=torch.randn(T,D,dtype=kv.dtype,device=dev); sin=torch.randn(T,D,dtype=kv.dtype,device=dev)
    moved = 2*kv.numel()*2
    for inter in (False, True):
        for mode in ("cache","per_token"):
            for br,nw in ((None,None),(16,4),(32,8)):
                if mode=="cache": f=lambda: launch_fused_kv_materialize(kp,vp,w,eps,0.0,cache,None,pos,ko,vo,H,D,D,inter,block_rows=br,num_warps=nw)
                else: f=lambda: launch_fused_kv_materialize(kp,vp,w,eps,0.0,cos,sin,None,ko,vo,H,D,D,inter,block_rows=br,num_warps=nw)
                us=graph_us(f)
                print(f"T={T} interleaved={inter} {mode:9s} {br}x{nw}: {us:7.1f} us {moved/us/1e6:5.2f} TB/s")
