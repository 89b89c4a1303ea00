#!/usr/bin/env python3
"""The GPU peer of DTK's benchmark (tools/bench/gpu_gpt2.sh): a nanoGPT-style GPT-2 in PyTorch, the
shape of configs/gpt2-small.pbtxt (12 layers, hidden 768, 12 heads, seq 1024, vocabulary 50257
padded to 50304, tied embedding, learned positions, pre-LayerNorm, GeLU), no dropout, trained as
nanoGPT trains it: bf16 autocast over fp32 weights, flash attention through
scaled_dot_product_attention(is_causal=True), fused AdamW, gradient clipping to 1.0. One full step =
forward, backward, clip, optimizer step, on synthetic tokens.

--arch llama: a Llama of about the same size instead (issue 33's second row): RMSNorm, SwiGLU
(ffn 2048), rotary positions (base 10000, the halves of each head's channels paired, as
Megatron's and Hugging Face's rotate_half), grouped-query attention (12 heads, 4 key/value
groups), untied output layer, no biases, vocabulary 32000; the shape dtk runs from
configs/llama-tiny.pbtxt with gpu_gpt2.sh's --model llama overrides.

    python3 tools/bench/gpu_peer.py --batch 16 --steps 30 --warmup 10 [--arch llama] [--compile] [--profile DIR]

--profile DIR: the first two timed steps also run under torch.profiler (CPU ops and CUDA
kernels): DIR/peer.json is the Chrome trace and the top kernels by CUDA time and the GPU's idle
time go to stderr, to set next to dtk's logging.profile_steps table (tools/bench/gpu_gpt2.sh
--profile).

Prints one JSON line: median step time, tokens/s, TFLOP/s and MFU against --peak_tflops, counting
FLOPs as DTK does (core/runtime/src/flops.cpp: 6 N + 12 L h s per token, N the parameters)."""
import argparse, json, math, statistics, time

import torch
import torch.nn as nn
import torch.nn.functional as F


def idle_line(trace_path, steps, short_us=20.0):
    """The GPU's idle time in a Chrome trace, as dtk's profile reports it (core/runtime/src/timeline/
    device_idle.cpp): the recorded span (every complete event) less the union of the kernels'
    intervals, per step, in gaps under `short_us` (launches) and longer ones."""
    with open(trace_path) as f:
        # "Trace" is the profiler's own span, from its start to its stop: not the steps'.
        events = [e for e in json.load(f).get("traceEvents", [])
                  if e.get("ph") == "X" and "dur" in e and e.get("cat") != "Trace"]
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not kernels:
        return ""
    start = min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e["dur"]) for e in events)
    gaps, busy_until = [], start
    for k0, k1 in kernels:
        if k0 > busy_until:
            gaps.append(k0 - busy_until)
        busy_until = max(busy_until, k1)
    if end > busy_until:
        gaps.append(end - busy_until)
    short = [g for g in gaps if g < short_us]
    long = [g for g in gaps if g >= short_us]
    idle = sum(gaps)
    return (f"peer GPU idle: {idle / 1e3 / steps:.2f} ms per step of {(end - start) / 1e3 / steps:.2f} ms recorded "
            f"({100 * idle / max(end - start, 1e-9):.1f}%): {sum(short) / 1e3 / steps:.2f} ms in "
            f"{len(short) / steps:.0f} gaps under {short_us:.0f} us, {sum(long) / 1e3 / steps:.2f} ms in "
            f"{len(long) / steps:.0f} longer ones; longest (ms): " +
            ", ".join(f"{g / 1e3:.3f}" for g in sorted(long, reverse=True)[:5]))


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers, h, heads, seq, vocab):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def rms_norm(x, weight, eps):
    if hasattr(F, "rms_norm"):  # PyTorch 2.4+
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()  # older PyTorch (the --device cpu smoke test on Debian's 1.13)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def causal_attention(q, k, v):
    """Flash attention through scaled_dot_product_attention; grouped keys and values read per group
    where PyTorch can (2.5+). The fallbacks serve the --device cpu smoke test on an old PyTorch."""
    if k.shape[1] != q.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except (TypeError, AttributeError):
            r = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(r, dim=1) for t in (k, v))
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


class LlamaBlock(nn.Module):
    def __init__(self, h, heads, groups, ffn, eps=1e-5):
        super().__init__()
        self.heads, self.groups, self.hd, self.eps = heads, groups, h // heads, eps
        self.norm1, self.norm2 = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, (heads + 2 * groups) * self.hd, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = self.qkv(rms_norm(x, self.norm1, self.eps)).split(
            [self.heads * self.hd, self.groups * self.hd, self.groups * self.hd], dim=2)
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)
        k = k.view(b, s, self.groups, self.hd).transpose(1, 2)
        v = v.view(b, s, self.groups, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = causal_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(rms_norm(x, self.norm2, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Llama(nn.Module):
    def __init__(self, layers, h, heads, groups, ffn, seq, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(LlamaBlock(h, heads, groups, ffn) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(h))
        self.output = nn.Linear(h, vocab, bias=False)
        hd = h // heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.output(rms_norm(x, self.norm, 1e-5))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (tiny shapes)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=0, help="default: 50304 (gpt), 32000 (llama)")
    ap.add_argument("--groups", type=int, default=4, help="llama: key/value groups")
    ap.add_argument("--ffn", type=int, default=2048, help="llama: SwiGLU width")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--peak_tflops", type=float, default=989.0)
    ap.add_argument("--profile", default="")
    a = ap.parse_args()
    torch.manual_seed(1234)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vocab = a.vocab or (32000 if a.arch == "llama" else 50304)
    tokens_vocab = 32000 if a.arch == "llama" else 50257
    tokens_vocab = min(tokens_vocab, vocab)
    if a.arch == "llama":
        model = Llama(a.layers, a.hidden, a.heads, a.groups, a.ffn, a.seq, vocab).to(dev)
    else:
        model = GPT(a.layers, a.hidden, a.heads, a.seq, vocab).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = (torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=True) if cuda
           else torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95)))
    fwd = torch.compile(model) if a.compile else model
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * n_params + 12 * a.layers * a.hidden * a.seq
    times = []
    profiler = None
    for step in range(a.warmup + a.steps):
        if a.profile and step == a.warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] +
                                              ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
            profiler.__enter__()
        tokens = torch.randint(0, tokens_vocab, (a.batch, a.seq + 1), device=dev)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = fwd(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        if profiler is not None and step == a.warmup + 1:
            profiler.__exit__(None, None, None)
            import os, sys
            os.makedirs(a.profile, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(a.profile, "peer.json"))
            print(f"peer profile of 2 steps ({1e3 * sum(times[-2:]):.1f} ms wall):", file=sys.stderr)
            print(idle_line(os.path.join(a.profile, "peer.json"), 2), file=sys.stderr)
            averages = profiler.key_averages()
            # PyTorch 2.x names the GPU's times "device" (1.13: "cuda").
            for key in (["self_device_time_total", "self_cuda_time_total"] if cuda else ["self_cpu_time_total"]):
                try:
                    print(averages.table(sort_by=key, row_limit=30, max_name_column_width=120), file=sys.stderr)
                    break
                except AttributeError:
                    continue
            profiler = None
    t = statistics.median(times)
    tokens_per_s = a.batch * a.seq / t
    tflops = flops_per_token * tokens_per_s / 1e12
    print(json.dumps({"peer": ("llama " if a.arch == "llama" else "") + "pytorch " + torch.__version__ +
                      (" torch.compile" if a.compile else " eager"),
                      "batch": a.batch, "step_ms": round(1e3 * t, 2), "tokens_per_second": round(tokens_per_s),
                      "tflops": round(tflops, 1), "mfu": round(tflops / a.peak_tflops, 4),
                      "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                      "loss": round(loss.item(), 4)}))


if __name__ == "__main__":
    main()
