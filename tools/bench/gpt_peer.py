#!/usr/bin/env python3
"""The eager-PyTorch peer of DTK's training step: the same GPT (Megatron's GPTModel as the `gpt`
plugin builds it: pre-LayerNorm, learned positions, tied embedding, exact GeLU, attention scores
masked with -10000 and softmaxed in fp32, dropout on embeddings, attention probabilities and both
residual branches), the same loss (mean cross entropy over the padded vocabulary), gradient
clipping to 1.0 and AdamW (weight decay 0.01 on weights, none on biases and norms), written as a
user writes it in plain PyTorch. One full step = forward, backward, clip, optimizer step.

    /usr/bin/python3 tools/bench/gpt_peer.py --layers 6 --hidden 384 --heads 6 --seq 256 \
        --batch 8 --vocab 50257 --steps 10 --warmup 3 --threads 2

Prints one JSON line: median step time, tokens/s, peak RSS. Run it with the allocator DTK uses
(tools/bench/step_vs_pytorch.sh preloads the same tcmalloc for both)."""
import argparse, json, math, resource, statistics, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Layer(nn.Module):
    def __init__(self, h, heads, ffn, p, init_std, out_std):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.dense = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)
        for lin, std in ((self.qkv, init_std), (self.dense, out_std), (self.fc1, init_std), (self.fc2, out_std)):
            nn.init.normal_(lin.weight, 0.0, std)
            nn.init.zeros_(lin.bias)

    def forward(self, x, causal):
        b, s, h = x.shape
        d = h // self.heads
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads, 3 * d).transpose(1, 2)
        q, k, v = qkv.split(d, dim=-1)
        scores = torch.matmul(q * (1.0 / math.sqrt(d)), k.transpose(-1, -2))
        probs = torch.softmax(scores.float().masked_fill(causal, -10000.0), dim=-1).to(x.dtype)
        ctx = torch.matmul(F.dropout(probs, self.p, self.training), v)
        ctx = ctx.transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.dense(ctx), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class GPT(nn.Module):
    def __init__(self, layers, h, heads, seq, vocab, p=0.1, init_std=0.02):
        super().__init__()
        padded = (vocab + 127) // 128 * 128  # Megatron's make_vocab_size_divisible_by 128
        self.wte, self.wpe = nn.Embedding(padded, h), nn.Embedding(seq, h)
        nn.init.normal_(self.wte.weight, 0.0, init_std)
        nn.init.normal_(self.wpe.weight, 0.0, init_std)
        out_std = init_std / math.sqrt(2.0 * layers)
        self.layers = nn.ModuleList(Layer(h, heads, 4 * h, p, init_std, out_std) for _ in range(layers))
        self.ln_f, self.p = nn.LayerNorm(h), p
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq))

    def forward(self, tokens, labels):
        s = tokens.shape[1]
        x = F.dropout(self.wte(tokens) + self.wpe(torch.arange(s)), self.p, self.training)
        for layer in self.layers:
            x = layer(x, self.causal[:, :, :s, :s])
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def main():
    a = argparse.ArgumentParser()
    for name, default in (("layers", 2), ("hidden", 64), ("heads", 4), ("seq", 64), ("batch", 8), ("vocab", 50257),
                          ("steps", 10), ("warmup", 3), ("threads", 2), ("seed", 1234)):
        a.add_argument("--" + name, type=int, default=default)
    args = a.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.hidden, args.heads, args.seq, args.vocab)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.999), eps=1e-8, foreach=True)
    model.train()
    times = []
    for step in range(args.warmup + args.steps):
        text = torch.randint(args.vocab, (args.batch, args.seq + 1))
        t0 = time.perf_counter()
        loss = model(text[:, :-1], text[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    print(json.dumps({"peer": "eager PyTorch " + torch.__version__, "threads": torch.get_num_threads(),
                      "step_time_ms_median": median * 1e3, "tokens_per_second": args.batch * args.seq / median,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                      "loss": float(loss)}))


if __name__ == "__main__":
    main()
