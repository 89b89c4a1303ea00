#!/usr/bin/env python3
"""Analytic model of Domino's gain (docs/domino.md): per transformer layer, the compute time and the
tensor-parallel all-reduce time of one micro-batch, plain TP (serial) vs Domino (overlapped).

    python3 tools/domino_model.py [--tflops 600] [--nvlink 400] [--ib 100] [--latency_us 10]

Assumptions (all overridable): bf16; achieved matmul rate F per GPU (--tflops; H100 SXM peak 989
dense, 600 ~ 60% of it); ring all-reduce time = latency + 2 (t-1)/t x bytes / busBW with NCCL's
bus bandwidth busBW of NVLink inside a DGX-H100 (--nvlink GB/s) or, for a TP group spanning two
nodes, of the inter-node InfiniBand path (--ib GB/s per GPU ring; 8 x 400 Gb/s ConnectX-7 per
node). Per layer: forward FLOPs (24 b s h^2 + 4 b s^2 h) / t, backward twice that; four
all-reduces of b s h bf16 values (two forward, two backward). Plain TP pays compute + comm;
Domino with enough chunks pays max(compute, comm) (what it can reach: chunked GEMMs running
slower and the stack's first and last chunk are ignored).
"""
import argparse

p = argparse.ArgumentParser()
p.add_argument("--tflops", type=float, default=600.0)
p.add_argument("--nvlink", type=float, default=400.0)
p.add_argument("--ib", type=float, default=100.0)
p.add_argument("--latency_us", type=float, default=10.0)
a = p.parse_args()

models = [("GPT-3 6.7B", 32, 4096), ("GPT-3 13B", 40, 5120)]
shapes = [(4, 2048), (16, 512)]
links = [("8xH100, 1 node, TP=8", 8, a.nvlink), ("2 nodes, TP=16", 16, a.ib)]
print(f"F = {a.tflops:.0f} TFLOP/s per GPU, NVLink busBW {a.nvlink:.0f} GB/s, cross-node busBW {a.ib:.0f} GB/s, "
      f"latency {a.latency_us:.0f} us")
print(f"| model | setup | micro-batch x seq | compute / layer (ms) | all-reduce / layer (ms) | comm share, plain TP | "
      f"Domino speed-up bound |")
print("|---|---|---|---|---|---|---|")
for name, layers, h in models:
    for setup, t, bw in links:
        for b, s in shapes:
            flops = 3 * (24 * b * s * h * h + 4 * b * s * s * h) / t
            compute = flops / (a.tflops * 1e12)
            size = 2 * b * s * h  # bytes of one all-reduce (bf16)
            one = a.latency_us * 1e-6 + 2 * (t - 1) / t * size / (bw * 1e9)
            comm = 4 * one
            plain, domino = compute + comm, max(compute, comm)
            print(f"| {name} | {setup} | {b} x {s} | {compute * 1e3:.2f} | {comm * 1e3:.2f} | {100 * comm / plain:.0f}% | "
                  f"{plain / domino:.2f}x |")
