#!/usr/bin/env python3
"""The GPU peer of DTK's benchmark (tools/bench/gpu_gpt2.sh): a nanoGPT-style GPT-2 in PyTorch, the
shape of configs/gpt2-small.pbtxt (12 layers, hidden 768, 12 heads, seq 1024, vocabulary 50257
padded to 50304, tied embedding, learned positions, pre-LayerNorm, GeLU), no dropout, trained as
nanoGPT trains it: bf16 autocast over fp32 weights, flash attention through
scaled_dot_product_attention(is_causal=True), fused AdamW, gradient clipping to 1.0. One full step =
forward, backward, clip, optimizer step, on synthetic tokens.

    python3 tools/bench/gpu_peer.py --batch 16 --steps 30 --warmup 10 [--compile] [--profile DIR]

--profile DIR: the first two timed steps also run under torch.profiler (CPU ops and CUDA
kernels): DIR/peer.json is the Chrome trace and the top kernels by CUDA time go to stderr, to
set next to dtk's logging.profile_steps table (tools/bench/gpu_gpt2.sh --profile).

Prints one JSON line: median step time, tokens/s, TFLOP/s and MFU against --peak_tflops, counting
FLOPs as DTK does (core/runtime/src/flops.cpp: 6 N + 12 L h s per token, N the parameters)."""
import argparse, json, math, statistics, time

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--peak_tflops", type=float, default=989.0)
    ap.add_argument("--profile", default="")
    a = ap.parse_args()
    torch.manual_seed(1234)
    dev = torch.device("cuda")
    model = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=True)
    fwd = torch.compile(model) if a.compile else model
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * n_params + 12 * a.layers * a.hidden * a.seq
    times = []
    profiler = None
    for step in range(a.warmup + a.steps):
        if a.profile and step == a.warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        tokens = torch.randint(0, 50257, (a.batch, a.seq + 1), device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        if profiler is not None and step == a.warmup + 1:
            profiler.__exit__(None, None, None)
            import os, sys
            os.makedirs(a.profile, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(a.profile, "peer.json"))
            print(f"peer profile of 2 steps ({1e3 * sum(times[-2:]):.1f} ms wall):", file=sys.stderr)
            print(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=15), file=sys.stderr)
            profiler = None
    t = statistics.median(times)
    tokens_per_s = a.batch * a.seq / t
    tflops = flops_per_token * tokens_per_s / 1e12
    print(json.dumps({"peer": "pytorch " + torch.__version__ + (" torch.compile" if a.compile else " eager"),
                      "batch": a.batch, "step_ms": round(1e3 * t, 2), "tokens_per_second": round(tokens_per_s),
                      "tflops": round(tflops, 1), "mfu": round(tflops / a.peak_tflops, 4),
                      "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      "loss": round(loss.item(), 4)}))


if __name__ == "__main__":
    main()
