"""Same-process A/B of the forward's half last KV tile (HALF_TAIL on/off) on PMA, GEM and dense, rotating order.

    python scripts/ab_fwd_half_tail.py OUT.json        (GPU host, .gpu-bundle active)
"""
import json, sys, torch
from jfa import specs, envinfo
from jfa.bench import do_bench_median
from jfa.jagged import gem_lengths
from jfa.kernels import jagged_fwd as m
VARIANTS = [False, True]
ROUNDS = 4
def offs(lengths):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
G = lambda L, s: [int(x) for x in gem_lengths(specs.GEM_BATCH, L, s, seed=specs.BENCH_SEED)]
cases = [("pma q=256 kv~U[1,2048]", 256, G(2048, 0.5), 4, 128), ("pma q=64 kv~U[1,2048]", 64, G(2048, 0.5), 4, 128),
         ("gem L=256 s=0.5", None, G(256, 0.5), 4, 128), ("gem L=256 s=1", None, G(256, 1.0), 4, 128),
         ("gem L=512 s=0.5", None, G(512, 0.5), 4, 128), ("gem L=1024 s=1", None, G(1024, 1.0), 4, 128),
         ("gem L=2048 s=0.5", None, G(2048, 0.5), 4, 128), ("dense D=128", None, [4096] * 4, 32, 128),
         ("gem L=1024 s=0.5 D=64 H=8", None, G(1024, 0.5), 8, 64)]
orig = {key: dict(t) for key, t in m.TUNING.items()}
def setv(v):
    for key in m.TUNING:
        m.TUNING[key] = dict(orig[key], HALF_TAIL=v)
def ref_check(out, q, k, v, lens, qlen):
    # fp32 reference on a few sequences (every row of them)
    errs = []
    kvo = [0] + torch.tensor(lens).cumsum(0).tolist()
    qo = kvo if qlen is None else [i * qlen for i in range(len(lens) + 1)]
    for s in list(range(0, len(lens), max(1, len(lens) // 16)))[:16]:
        kk = k[kvo[s]:kvo[s + 1]].float(); vv = v[kvo[s]:kvo[s + 1]].float()
        qq = (q if qlen is not None else q[kvo[s]:kvo[s + 1]]).float()
        rep = qq.shape[1] // kk.shape[1]
        kk = kk.repeat_interleave(rep, 1); vv = vv.repeat_interleave(rep, 1)
        sc = torch.einsum("qhd,khd->hqk", qq, kk) / qq.shape[-1] ** 0.5
        o = torch.einsum("hqk,khd->qhd", sc.softmax(-1), vv)
        got = out[qo[s]:qo[s + 1]].float()
        errs.append(float((got - o).norm() / o.norm()))
    return max(errs)
rows = []
for name, qlen, lens, H, D in cases:
    off = offs(lens); bq = qlen is not None
    q = torch.randn(qlen if bq else sum(lens), H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = specs.attention_flops([qlen] * len(lens) if bq else lens, lens, H, D)
    args = (off, off, qlen if bq else max(lens), max(lens), None, False, None, bq)
    res = dict(case=name, ms={}, relerr_vs_ref={}, max_abs_diff_vs_False=None)
    outs = {}
    for r in range(ROUNDS):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for vv in order:
            setv(vv)
            o = torch.full((len(lens) * qlen if bq else sum(lens), H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
            out, lse = m.jagged_attention_fwd(q, k, v, *args, out=o)
            if r == 0:
                outs[vv] = out.clone()
                res["relerr_vs_ref"][str(vv)] = ref_check(out, q, k, v, lens, qlen)
                res.setdefault("nan_rows", {})[str(vv)] = int(out.isnan().any(-1).any(-1).sum())
            res["ms"].setdefault(str(vv), []).append(do_bench_median(lambda: m.jagged_attention_fwd(q, k, v, *args), []))
    setv(orig[(128, 1)]["HALF_TAIL"])
    res["max_abs_diff_vs_False"] = float((outs[True].float() - outs[False].float()).abs().max())
    res["tflops_median"] = {vv: flops / sorted(t)[len(t) // 2] / 1e9 for vv, t in res["ms"].items()}
    print(name.ljust(26), "  ".join(f"{vv} {tf:6.1f}" for vv, tf in res["tflops_median"].items()),
          "relerr", res["relerr_vs_ref"], "nan", res["nan_rows"], "diff", res["max_abs_diff_vs_False"], flush=True)
    rows.append(res)
    del q, k, v, outs
    torch.cuda.empty_cache()
json.dump(dict(kind="A/B forward half last KV tile", env=envinfo.environment(), rows=rows), open(sys.argv[1], "w"), indent=1)
