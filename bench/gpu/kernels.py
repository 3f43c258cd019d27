#!/usr/bin/env python3
"""Checks and times the kernels of kernels/ through the C ABI (libmonarch_kernels_capi.so).

GPU mode (default): every CUDA kernel against its CPU reference (same library) and against the
equivalent torch ops on CUDA (quantize vs a torch formula, pack vs torch.cat/.to, AdamW vs
torch.optim.AdamW(fused=True), cross-entropy vs F.cross_entropy and autograd); then times them:
achieved GB/s against the copy bandwidth measured with a big tensor.copy_(), fused AdamW
against torch.optim.AdamW fused and foreach.
--cpu: the CPU references through ctypes against torch CPU ops, timed the same way (small sizes).
Prints a table and writes a JSON file (--out). Exits 1 if any check failed.
"""
import argparse
import ctypes
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

I64, I32, F32, P = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
IP = ctypes.c_ssize_t  # intptr_t
QUANT = [IP, IP, IP, IP, I64, I64]
DEQUANT = [IP, IP, IP, I64, I64, I32]
PACK = [P, P, P, I64, IP, I32, F32]
UNPACK = [IP, I32, P, P, P, I64, F32, I32]
ADAMW = [P, P, P, P, P, P, I64, F32, F32, F32, F32, F32, I64]
CEMAX = [IP, I64, I64, IP]
CESUM = [IP, IP, I64, I64, I64, IP, IP, IP]
CEGRAD = [IP, IP, I64, I64, I64, IP, IP, IP, F32, I64, IP, IP]


class Lib:
    def __init__(self, path, cuda):
        self.lib = ctypes.CDLL(path)
        self.lib.mk_last_error.restype = ctypes.c_char_p
        self.lib.mk_has_cuda.restype = I32
        self.lib.mk_int8_num_blocks.restype = I64
        self.lib.mk_int8_num_blocks.argtypes = [I64, I64]
        self.cuda = cuda
        suffix = "cuda" if cuda else "cpu"
        for name, args in [("int8_quantize", QUANT), ("int8_dequantize", DEQUANT), ("bucket_pack", PACK),
                           ("bucket_unpack", UNPACK), ("adamw", ADAMW), ("ce_local_max", CEMAX),
                           ("ce_local_sumexp", CESUM), ("ce_loss_grad", CEGRAD)]:
            f = getattr(self.lib, f"mk_{name}_{suffix}")
            f.argtypes = args + ([IP] if cuda else [])
            f.restype = ctypes.c_int
            setattr(self, name, self._wrap(f))

    def _wrap(self, f):
        def call(*args):
            if self.cuda:
                args = args + (torch.cuda.current_stream().cuda_stream,)
            if f(*args) != 0:
                raise RuntimeError(self.lib.mk_last_error().decode())
        return call


def ptr(t):
    return t.data_ptr() if t is not None else 0


def arr(ctype, values):
    return (ctype * max(1, len(values)))(*values)


DT = {torch.float32: 0, torch.bfloat16: 1}


# ---- the kernels, called on torch tensors ------------------------------------------------------

def quantize(lib, src, error, block):
    n = src.numel()
    q = torch.empty(n, dtype=torch.int8, device=src.device)
    scales = torch.empty(lib.lib.mk_int8_num_blocks(n, block), device=src.device)
    lib.int8_quantize(ptr(src), ptr(error), ptr(q), ptr(scales), n, block)
    return q, scales


def dequantize(lib, q, scales, block, dst=None):
    out = torch.empty(q.numel(), device=q.device) if dst is None else dst
    lib.int8_dequantize(ptr(q), ptr(scales), ptr(out), q.numel(), block, int(dst is not None))
    return out


def pack(lib, tensors, wire_dtype, scale):
    wire = torch.empty(sum(t.numel() for t in tensors), dtype=wire_dtype, device=tensors[0].device)
    lib.bucket_pack(arr(IP, [ptr(t) for t in tensors]), arr(I64, [t.numel() for t in tensors]),
                    arr(I32, [DT[t.dtype] for t in tensors]), len(tensors), ptr(wire), DT[wire_dtype], scale)
    return wire


def unpack(lib, wire, dsts, scale, accumulate):
    lib.bucket_unpack(ptr(wire), DT[wire.dtype], arr(IP, [ptr(t) for t in dsts]), arr(I64, [t.numel() for t in dsts]),
                      arr(I32, [DT[t.dtype] for t in dsts]), len(dsts), scale, int(accumulate))


def adamw(lib, params, grads, m, v, bf16, h):
    lib.adamw(arr(IP, [ptr(t) for t in params]), arr(IP, [ptr(t) for t in grads]), arr(IP, [ptr(t) for t in m]),
              arr(IP, [ptr(t) for t in v]), arr(IP, [ptr(t) for t in bf16]) if bf16 is not None else None,
              arr(I64, [t.numel() for t in params]), len(params), h["lr"], h["beta1"], h["beta2"], h["eps"],
              h["weight_decay"], h["step"])


def cross_entropy(lib, shards, starts, targets, grad_scale, in_place=False):
    """The three passes over the vocab shards, the all-reduces done here with torch ops."""
    rows = targets.numel()
    dev = targets.device
    gmax = torch.full((rows,), -float("inf"), device=dev)
    for sh in shards:
        lm = torch.empty(rows, device=dev)
        lib.ce_local_max(ptr(sh), rows, sh.shape[1], ptr(lm))
        gmax = torch.maximum(gmax, lm)
    gsum, gt = torch.zeros(rows, device=dev), torch.zeros(rows, device=dev)
    for sh, st in zip(shards, starts):
        se, tl = torch.empty(rows, device=dev), torch.empty(rows, device=dev)
        lib.ce_local_sumexp(ptr(sh), ptr(targets), rows, sh.shape[1], st, ptr(gmax), ptr(se), ptr(tl))
        gsum += se
        gt += tl
    loss, grads = torch.empty(rows, device=dev), []
    for sh, st in zip(shards, starts):
        g = sh if in_place else torch.empty_like(sh)
        lib.ce_loss_grad(ptr(sh), ptr(targets), rows, sh.shape[1], st, ptr(gmax), ptr(gsum), ptr(gt),
                         grad_scale, -100, ptr(loss), ptr(g))
        grads.append(g)
    return loss, grads


# ---- torch equivalents -------------------------------------------------------------------------

def quantize_torch(src, error, block):
    n = src.numel()
    nb = (n + block - 1) // block
    c = src + error if error is not None else src.clone()
    padded = torch.zeros(nb * block, device=src.device)
    padded[:n] = c
    b = padded.view(nb, block)
    amax = b.abs().amax(1)
    scales = torch.div(amax, torch.full_like(amax, 127.0))  # true division (not * 1/127)
    s = scales[:, None].expand(nb, block)
    x = b / s
    t = x.trunc()
    r = torch.where((x - t).abs() >= 0.5, t + x.sign(), t).clamp(-127, 127)
    qf = torch.where(s == 0, torch.zeros_like(b), r)
    res = b - qf * s
    return qf.reshape(-1)[:n].to(torch.int8), scales, res.reshape(-1)[:n]


class Report:
    def __init__(self):
        self.checks, self.timings = [], []

    def check(self, name, ok, detail=""):
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"  [{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)

    def close(self, name, a, b, rtol, atol):
        a, b = a.float().cpu(), b.float().cpu()
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        self.check(name, a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True),
                   f"max|diff|={diff:.3g}")

    def equal(self, name, a, b):
        a, b = a.cpu(), b.cpu()
        same = a.shape == b.shape and torch.equal(a, b)
        n = 0 if same or a.shape != b.shape else int((a != b).sum())
        self.check(name, same, "bit-exact" if same else f"{n} elements differ")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, iters, warmup=2):
    for _ in range(warmup):
        fn()
    sync(dev)
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


# ---- checks ------------------------------------------------------------------------------------

def run_checks(rep, cpu_lib, dev_lib, dev):
    """cpu_lib: the CPU references; dev_lib: the CUDA kernels (None in --cpu mode)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    print("quantize", flush=True)
    for n, block in [(0, 64), (1, 64), (4099, 64), (100003, 256), (65536, 1)]:
        src, err = randn(n, scale=3.0), randn(n, scale=0.01)
        src[: min(n, 64)] = 0 if block == 64 else src[: min(n, 64)]  # an all-zero block
        e_cpu = err.clone()
        q, s = quantize(cpu_lib, src, e_cpu, block)
        tq, ts, tr = quantize_torch(src, err, block)
        rep.equal(f"int8 quantize cpu vs torch n={n} block={block}", torch.cat([q.float(), s, e_cpu]),
                  torch.cat([tq.float(), ts, tr]))
        if dev_lib:
            e_dev = err.to(dev)
            qd, sd = quantize(dev_lib, src.to(dev), e_dev, block)
            rep.equal(f"int8 quantize cuda vs cpu n={n} block={block}", torch.cat([qd.float(), sd, e_dev]).cpu(),
                      torch.cat([q.float(), s, e_cpu]))
            tqd, tsd, trd = quantize_torch(src.to(dev), err.to(dev), block)
            rep.equal(f"int8 quantize cuda vs torch-cuda n={n} block={block}",
                      torch.cat([qd.float(), sd, e_dev]), torch.cat([tqd.float(), tsd, trd]))
            acc = randn(n).to(dev)
            ref = acc.cpu() + dequantize(cpu_lib, q, s, block)
            rep.equal(f"int8 dequantize(accumulate) cuda vs cpu n={n}", dequantize(dev_lib, qd, sd, block, acc).cpu(), ref)

    print("bucket pack/unpack", flush=True)
    sizes = [1000, 1, 257, 0, 3, 40961] + [17] * 40  # > 32 tensors: several launches
    for wire in (torch.float32, torch.bfloat16):
        srcs = [randn(n, scale=5.0).to(torch.bfloat16 if i % 2 else torch.float32) for i, n in enumerate(sizes)]
        scale = 1.0 / 3.0
        w = pack(cpu_lib, srcs, wire, scale)
        ref = torch.cat([t.float() * scale for t in srcs]).to(wire)
        rep.equal(f"pack cpu vs torch.cat/.to wire={wire}", w, ref)
        if dev_lib:
            ds = [t.to(dev) for t in srcs]
            wd = pack(dev_lib, ds, wire, scale)
            rep.equal(f"pack cuda vs cpu wire={wire}", wd.cpu(), w)
            rep.equal(f"pack cuda vs torch-cuda wire={wire}", wd, torch.cat([t.float() * scale for t in ds]).to(wire))
        dsts = [randn(t.numel()).to(t.dtype) for t in srcs]
        expect = []
        off = 0
        for d in dsts:
            expect.append((d.float() + w[off:off + d.numel()].float() * 0.5).to(d.dtype))
            off += d.numel()
        got = [d.clone() for d in dsts]
        unpack(cpu_lib, w, got, 0.5, True)
        rep.equal(f"unpack(accumulate) cpu vs torch wire={wire}", torch.cat([x.float() for x in got]),
                  torch.cat([x.float() for x in expect]))
        if dev_lib:
            gd = [d.to(dev) for d in dsts]
            unpack(dev_lib, w.to(dev), gd, 0.5, True)
            rep.equal(f"unpack(accumulate) cuda vs cpu wire={wire}", torch.cat([x.float() for x in gd]).cpu(),
                      torch.cat([x.float() for x in got]))

    print("adamw", flush=True)
    h = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=0)
    shapes = [1, 0, 4099, 1000, 17] + [33] * 30
    init = [randn(n) for n in shapes]

    def make(device):
        return ([t.clone().to(device) for t in init], [torch.zeros(n, device=device) for n in shapes],
                [torch.zeros(n, device=device) for n in shapes],
                [torch.zeros(n, dtype=torch.bfloat16, device=device) for n in shapes])

    p, m, v, b = make("cpu")
    ref = [t.clone().requires_grad_(True) for t in init]
    opt = torch.optim.AdamW(ref, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"], foreach=False)
    if dev_lib:
        pd, md, vd, bd = make(dev)
        refd = [t.clone().to(dev).requires_grad_(True) for t in init]
        try:
            optd = torch.optim.AdamW(refd, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                     weight_decay=h["weight_decay"], fused=True)
        except (TypeError, RuntimeError):
            optd = None
    for step in range(1, 6):
        grads = [randn(n, scale=1.0 if step % 2 else 1e-3) for n in shapes]
        h["step"] = step
        adamw(cpu_lib, p, grads, m, v, b, h)
        for r, gr in zip(ref, grads):
            r.grad = gr.clone()
        opt.step()
        if dev_lib:
            adamw(dev_lib, pd, [x.to(dev) for x in grads], md, vd, bd, h)
            if optd:
                for r, gr in zip(refd, grads):
                    r.grad = gr.to(dev)
                optd.step()
    rep.close("adamw cpu vs torch.optim.AdamW (5 steps)", torch.cat(p), torch.cat([r.detach() for r in ref]), 1e-5, 1e-7)
    rep.equal("adamw cpu bf16 copies == param.to(bfloat16)", torch.cat(b), torch.cat(p).to(torch.bfloat16))
    if dev_lib:
        rep.equal("adamw cuda vs cpu (params, moments, bf16)",
                  torch.cat([torch.cat(pd), torch.cat(md), torch.cat(vd), torch.cat(bd).float()]).cpu(),
                  torch.cat([torch.cat(p), torch.cat(m), torch.cat(v), torch.cat(b).float()]))
        if optd:
            rep.close("adamw cuda vs torch.optim.AdamW(fused=True)", torch.cat(pd),
                      torch.cat([r.detach() for r in refd]), 1e-5, 1e-6)
        else:
            rep.check("adamw cuda vs torch.optim.AdamW(fused=True)", True, "skipped: no fused AdamW in this torch")

    print("cross-entropy", flush=True)
    for rows, vocab, splits in [(1, 11, [11]), (37, 1009, [500, 509]), (64, 5003, [1667, 1, 3335])]:
        logits = randn(rows, vocab, scale=4.0)
        targets = torch.randint(0, vocab, (rows,), generator=g)
        if rows > 1:
            targets[1] = -100
        valid = max(1, int((targets != -100).sum()))
        starts = [sum(splits[:i]) for i in range(len(splits))]
        shards = [logits[:, s:s + w].contiguous() for s, w in zip(starts, splits)]
        loss, grads = cross_entropy(cpu_lib, shards, starts, targets, 1.0 / valid)
        lr = logits.clone().requires_grad_(True)
        ref_loss = F.cross_entropy(lr, targets, reduction="none", ignore_index=-100)
        ref_loss.sum().div(valid).backward()
        rep.close(f"cross-entropy loss cpu vs F.cross_entropy rows={rows} vocab={vocab}", loss, ref_loss.detach(), 1e-5, 1e-5)
        rep.close(f"cross-entropy grad cpu vs autograd rows={rows} vocab={vocab}", torch.cat(grads, 1), lr.grad, 1e-5, 1e-7)
        if dev_lib:
            sd = [s.to(dev) for s in shards]
            lossd, gradsd = cross_entropy(dev_lib, sd, starts, targets.to(dev), 1.0 / valid, in_place=True)
            rep.close(f"cross-entropy cuda vs cpu rows={rows} vocab={vocab}", torch.cat([lossd[:, None], torch.cat(gradsd, 1)], 1),
                      torch.cat([loss[:, None], torch.cat(grads, 1)], 1), 1e-5, 1e-6)
            ld = logits.to(dev).requires_grad_(True)
            rl = F.cross_entropy(ld, targets.to(dev), reduction="none", ignore_index=-100)
            rl.sum().div(valid).backward()
            rep.close(f"cross-entropy cuda vs F.cross_entropy(cuda) rows={rows} vocab={vocab}", lossd, rl.detach(), 1e-5, 1e-5)
            rep.close(f"cross-entropy cuda grad vs autograd(cuda) rows={rows} vocab={vocab}", torch.cat(gradsd, 1), ld.grad, 1e-5, 1e-7)


# ---- timings -----------------------------------------------------------------------------------

def run_timings(rep, lib, dev, big):
    """big: elements of the large fp32 buffers (GPU: 2^26, CPU: 2^20)."""
    iters = 20 if dev.type == "cuda" else 3
    x = torch.randn(big, device=dev)
    y = torch.empty_like(x)
    t = timeit(lambda: y.copy_(x), dev, iters)
    copy_gbs = 2 * x.numel() * 4 / t / 1e9
    rep.timings.append({"op": "tensor.copy_ (reference)", "seconds": t, "bytes": 8 * big, "GB/s": copy_gbs, "vs_copy": 1.0})

    def row(op, seconds, nbytes, torch_op=None, torch_seconds=None):
        gbs = nbytes / seconds / 1e9
        rep.timings.append({"op": op, "seconds": seconds, "bytes": nbytes, "GB/s": gbs, "vs_copy": gbs / copy_gbs,
                            "torch_op": torch_op, "torch_seconds": torch_seconds,
                            "speedup_vs_torch": (torch_seconds / seconds) if torch_seconds else None})

    n, block = big, 256
    err = torch.zeros(n, device=dev)
    q = torch.empty(n, dtype=torch.int8, device=dev)
    s = torch.empty(lib.lib.mk_int8_num_blocks(n, block), device=dev)
    tq = timeit(lambda: lib.int8_quantize(ptr(x), ptr(err), ptr(q), ptr(s), n, block), dev, iters)
    tt = timeit(lambda: quantize_torch(x, err, block), dev, max(1, iters // 4))
    row(f"int8_quantize n={n} block={block} (error feedback)", tq, 13 * n + 4 * s.numel(), "torch formula", tt)
    td = timeit(lambda: lib.int8_dequantize(ptr(q), ptr(s), ptr(y), n, block, 1), dev, iters)
    row("int8_dequantize (accumulate)", td, 9 * n + 4 * s.numel())

    srcs = list(torch.split(x, [big // 64] * 63 + [big - 63 * (big // 64)]))
    for wire in (torch.float32, torch.bfloat16):
        w = torch.empty(big, dtype=wire, device=dev)
        ps, cs, ds = arr(IP, [ptr(t) for t in srcs]), arr(I64, [t.numel() for t in srcs]), arr(I32, [0] * len(srcs))
        tp = timeit(lambda: lib.bucket_pack(ps, cs, ds, len(srcs), ptr(w), DT[wire], 0.5), dev, iters)
        tt = timeit(lambda: torch.cat([t * 0.5 for t in srcs]).to(wire), dev, iters)
        row(f"bucket_pack 64 tensors -> {str(wire).split('.')[-1]}", tp, big * (4 + w.element_size()), "torch.cat(t*s).to", tt)
        tu = timeit(lambda: lib.bucket_unpack(ptr(w), DT[wire], ps, cs, ds, len(srcs), 0.5, 1), dev, iters)
        row(f"bucket_unpack {str(wire).split('.')[-1]} -> 64 tensors (accumulate)", tu, big * (8 + w.element_size()))

    sizes = [big // 32] * 32
    params = [torch.randn(k, device=dev) for k in sizes]
    grads = [torch.randn(k, device=dev) for k in sizes]
    m = [torch.zeros(k, device=dev) for k in sizes]
    v = [torch.zeros(k, device=dev) for k in sizes]
    b = [torch.empty(k, dtype=torch.bfloat16, device=dev) for k in sizes]
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    ta = timeit(lambda: adamw(lib, params, grads, m, v, b, h), dev, iters)
    nel = sum(sizes)
    torch_times = {}
    for variant in ("fused", "foreach"):
        if variant == "fused" and dev.type != "cuda":
            continue
        ps_ = [torch.nn.Parameter(t.clone()) for t in params]
        for p_, g_ in zip(ps_, grads):
            p_.grad = g_
        try:
            opt = torch.optim.AdamW(ps_, lr=1e-3, weight_decay=0.01, **{variant: True})
            torch_times[variant] = timeit(opt.step, dev, iters)
        except (TypeError, RuntimeError) as e:
            print(f"  torch AdamW {variant}: unavailable ({e})")
    best = min(torch_times.items(), key=lambda kv: kv[1]) if torch_times else (None, None)
    row(f"adamw {len(sizes)} tensors, {nel} params, +bf16 copy", ta, 30 * nel,
        f"torch AdamW {best[0]}" if best[0] else None, best[1])
    for k, tv in torch_times.items():
        rep.timings.append({"op": f"torch.optim.AdamW({k}=True) (no bf16 copy)", "seconds": tv, "bytes": 28 * nel,
                            "GB/s": 28 * nel / tv / 1e9, "vs_copy": 28 * nel / tv / 1e9 / copy_gbs})

    rows = 4096 if dev.type == "cuda" else 256
    vocab = big // rows
    logits = torch.randn(rows, vocab, device=dev)
    targets = torch.randint(0, vocab, (rows,), device=dev)
    gmax, gsum, gt, loss = (torch.empty(rows, device=dev) for _ in range(4))
    grad = torch.empty_like(logits)

    def ce():
        lib.ce_local_max(ptr(logits), rows, vocab, ptr(gmax))
        lib.ce_local_sumexp(ptr(logits), ptr(targets), rows, vocab, 0, ptr(gmax), ptr(gsum), ptr(gt))
        lib.ce_loss_grad(ptr(logits), ptr(targets), rows, vocab, 0, ptr(gmax), ptr(gsum), ptr(gt), 1.0 / rows, -100,
                         ptr(loss), ptr(grad))

    tc = timeit(ce, dev, iters)
    lr = logits.clone().requires_grad_(True)

    def ce_torch():
        lr.grad = None
        F.cross_entropy(lr, targets).backward()

    tt = timeit(ce_torch, dev, iters)
    row(f"cross-entropy 3 passes fwd+bwd [{rows}, {vocab}]", tc, 16 * rows * vocab, "F.cross_entropy fwd+bwd", tt)
    return copy_gbs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True, help="path of libmonarch_kernels_capi.so")
    ap.add_argument("--cpu", action="store_true", help="check and time the CPU references only (no GPU)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "gpu.json"))
    ap.add_argument("--size", type=int, default=0, help="elements of the big timing buffers (default 2^26 GPU, 2^20 CPU)")
    a = ap.parse_args()

    cpu_lib = Lib(a.lib, cuda=False)
    rep = Report()
    if a.cpu:
        dev, dev_lib = torch.device("cpu"), None
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --cpu")
        if not cpu_lib.lib.mk_has_cuda():
            sys.exit(f"{a.lib} was built without CUDA (configure with -DMONARCH_WITH_CUDA=ON)")
        dev, dev_lib = torch.device("cuda"), Lib(a.lib, cuda=True)
        device = torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, device: {device}", flush=True)
    run_checks(rep, cpu_lib, dev_lib, dev)
    big = a.size or (1 << 26 if dev.type == "cuda" else 1 << 20)
    print("timings", flush=True)
    copy_gbs = run_timings(rep, dev_lib or cpu_lib, dev, big)

    print(f"\n{'op':58s} {'ms':>9s} {'GB/s':>8s} {'of copy':>8s} {'vs torch':>9s}")
    for r in rep.timings:
        sp = f"{r['speedup_vs_torch']:.2f}x" if r.get("speedup_vs_torch") else ""
        print(f"{r['op'][:58]:58s} {r['seconds'] * 1e3:9.3f} {r['GB/s']:8.1f} {100 * r['vs_copy']:7.0f}% {sp:>9s}")
    failed = [c for c in rep.checks if not c["ok"]]
    print(f"\nchecks: {len(rep.checks) - len(failed)} passed, {len(failed)} failed")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"mode": "cpu" if a.cpu else "cuda", "device": device, "torch": torch.__version__,
                   "copy_GB/s": copy_gbs, "checks": rep.checks, "timings": rep.timings,
                   "failed": len(failed)}, f, indent=1)
    print(f"wrote {a.out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
