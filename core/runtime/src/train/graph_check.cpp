#include "dtk/core/train/graph_check.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <unordered_set>

namespace dtk::core {

std::string unlisted_trained_tensors(const at::Tensor& loss, const std::vector<Param>& params) {
  if (!loss.defined() || !loss.grad_fn()) return "";
  std::unordered_set<const void*> listed;
  for (const Param& p : params) listed.insert(p.tensor.unsafeGetTensorImpl());
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{loss.grad_fn().get()};
  int64_t count = 0;
  std::string first;
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const at::Tensor& v = acc->variable;
      if (v.defined() && !listed.count(v.unsafeGetTensorImpl()) && count++ == 0)
        first = std::string(c10::toString(v.scalar_type())) + " " + shape_str(v);
      continue;
    }
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  if (count == 0) return "";
  return std::to_string(count) + (count == 1 ? " tensor the loss trains is" : " tensors the loss trains are") +
         " not listed by visit_parameters (the first: " + first +
         "): the optimizer would never update it and checkpoints would not hold it; list every trainable tensor "
         "in parameters()";
}

}  // namespace dtk::core
