// dtk/cuda/cross_entropy.hpp — the cross entropy of a block of logit rows in one kernel
// (src/cross_entropy.cu), for the fused output layer (dtk/layers/lm_head.hpp) on a GPU: what
// llm.c's fused classifier does. Each row is read once for its maximum and sum of exponentials
// together (an online softmax) and, with gradients, once more to write softmax - onehot over the
// logits, in their own type. The plain-op reference (amax, gather, exp, sum, div, scatter_add:
// seven passes over fp32 logits) is lm_head.cpp's cross_entropy_ops; tests/cuda holds them equal.
#pragma once

#include <cstdint>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

// n rows of `vocab` logits (row i at logits + i * ld elements; fp32, bf16 or fp16) on the device,
// and each row's target column (int64; -1 where the target is not among these columns). Queues
// on `stream`, per row i:
//   max[i] = max_j l[i, j],  sum[i] = sum_j exp(l[i, j] - max[i]),
//   loss[i] = log(sum[i]) - (l[i, col[i]] - max[i])   (the target term 0 where col[i] < 0),
// and with `grads` overwrites the row with softmax - onehot (exp(l - max) / sum, minus 1 at the
// target), rounded to the logits' type. max, sum and loss are fp32 arrays of n on the device.
void cross_entropy_rows(void* logits, ElementType type, int64_t n, int64_t vocab, int64_t ld, const int64_t* col,
                        float* max, float* sum, float* loss, bool grads, StreamHandle stream);

}  // namespace dtk::cuda
