#include "nccl_backend.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <dtk/abi.h>
#include <dtk/plugin.hpp>  // dtk::Error

#include <memory>
#include <mutex>
#include <string>

#include "dtk/host/error.hpp"  // HostError

#if DTK_HAVE_CUDA
#include "../device/cuda_glue.hpp"
#include "dtk/cuda/nccl.hpp"
#endif

namespace dtk::core::nccl_backend {

#if DTK_HAVE_CUDA
namespace {

std::mutex mu;
std::array<std::shared_ptr<dtk::cuda::NcclCommunicator>, kNumGroups> communicators;  // by dtk_group

std::shared_ptr<dtk::cuda::NcclCommunicator> communicator(int32_t group) {
  if (group < 0 || group >= static_cast<int32_t>(kNumGroups)) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  return communicators[static_cast<size_t>(group)];
}

dtk::cuda::DataType data_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return dtk::cuda::DataType::kFloat32;
    case at::kHalf:
      return dtk::cuda::DataType::kFloat16;
    case at::kBFloat16:
      return dtk::cuda::DataType::kBFloat16;
    case at::kDouble:
      return dtk::cuda::DataType::kFloat64;
    case at::kInt:
      return dtk::cuda::DataType::kInt32;
    case at::kLong:
      return dtk::cuda::DataType::kInt64;
    case at::kByte:
    case at::kBool:
      return dtk::cuda::DataType::kUInt8;
    case at::kChar:
      return dtk::cuda::DataType::kInt8;
    default:
      throw dtk::Error(std::string("nccl: no NCCL type for ") + c10::toString(t.scalar_type()),
                       DTK_ERR_INVALID_ARGUMENT);
  }
}

dtk::cuda::ReduceOp reduce_op(int32_t op) {
  switch (op) {
    case DTK_REDUCE_SUM:
      return dtk::cuda::ReduceOp::kSum;
    case DTK_REDUCE_AVG:
      return dtk::cuda::ReduceOp::kAvg;
    case DTK_REDUCE_MAX:
      return dtk::cuda::ReduceOp::kMax;
    case DTK_REDUCE_MIN:
      return dtk::cuda::ReduceOp::kMin;
    default:
      throw dtk::Error("nccl: unknown reduce op " + std::to_string(op), DTK_ERR_INVALID_ARGUMENT);
  }
}

// A contiguous buffer for `t` (the tensor itself when it is), and how to copy the result back.
at::Tensor contiguous(const at::Tensor& t, std::function<void()>* copy_back) {
  if (t.is_contiguous()) return t;
  at::Tensor buf = t.contiguous();
  *copy_back = [t, buf] {
    at::NoGradGuard ng;
    t.copy_(buf);
  };
  return buf;
}

dtk::cuda::StreamHandle torch_stream(const at::Tensor& t) {
  return cuda_glue::torch_current_stream(t.device().index());
}

// The finish of a pending collective: the torch stream waits for it; then the copy back (queued
// on that stream after the wait). `keep` holds the buffers until then.
Finish finisher(std::shared_ptr<dtk::cuda::NcclCommunicator> comm, dtk::cuda::NcclCommunicator::Pending pending,
                int device, std::vector<at::Tensor> keep, std::function<void()> copy_back) {
  return [comm = std::move(comm), pending = std::move(pending), device, keep = std::move(keep),
          copy_back = std::move(copy_back)] {
    comm->finish(pending, cuda_glue::torch_current_stream(device), /*host_wait=*/false);
    if (copy_back) copy_back();
  };
}

}  // namespace

void create(const GroupMembers& members, int world_rank, const c10::intrusive_ptr<c10d::Store>& store, int device,
            std::chrono::milliseconds timeout) {
  static const char* const kNames[kNumGroups] = {
      "world",          "data-parallel",   "tensor-parallel",      "pipeline-parallel",
      "model-parallel", "expert-parallel", "expert-data-parallel", "context-parallel"};
  std::array<std::shared_ptr<dtk::cuda::NcclCommunicator>, kNumGroups> made;
  const dtk::cuda::Rendezvous rendezvous{[store](const std::string& key, const std::string& value) {
                                           store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
                                         },
                                         [store](const std::string& key) {
                                           const std::vector<uint8_t> v = store->get(key);
                                           return std::string(v.begin(), v.end());
                                         }};
  // Every rank creates its groups in the same order (world, DP, TP, PP, MP, EP, EDP, CP by dtk_group); a key
  // names the group by its first member, so the ranks of one group meet under one key.
  for (size_t g = 0; g < members.size(); ++g) {
    const std::vector<int>& m = members[g];
    if (m.size() <= 1) continue;
    int mine = -1;
    for (size_t i = 0; i < m.size(); ++i)
      if (m[i] == world_rank) mine = static_cast<int>(i);
    if (mine < 0) continue;
    const std::string key = std::string(kNames[g]) + "/" + std::to_string(m.front());
    try {
      made[g] = std::make_shared<dtk::cuda::NcclCommunicator>(rendezvous, key, mine, static_cast<int>(m.size()), device,
                                                              timeout);
    } catch (const std::exception& e) {
      throw host::HostError(std::string("distributed: creating the NCCL communicator of the ") + kNames[g] +
                            " group on cuda:" + std::to_string(device) + " failed: " + e.what());
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  communicators = std::move(made);
}

void release() {
  std::array<std::shared_ptr<dtk::cuda::NcclCommunicator>, kNumGroups> gone;
  {
    std::lock_guard<std::mutex> lock(mu);
    gone.swap(communicators);
  }
}

bool handles(const at::Tensor& t, int32_t group) {
  return t.defined() && t.is_cuda() && communicator(group) != nullptr;
}

Finish all_reduce(const at::Tensor& x, int32_t group, int32_t op) {
  auto comm = communicator(group);
  std::function<void()> copy_back;
  const at::Tensor buf = contiguous(x, &copy_back);
  auto pending = comm->all_reduce(buf.data_ptr(), static_cast<size_t>(buf.numel()), data_type(buf), reduce_op(op),
                                  torch_stream(buf));
  return finisher(std::move(comm), std::move(pending), x.device().index(), {buf}, std::move(copy_back));
}

Finish broadcast(const at::Tensor& x, int32_t group, int32_t root) {
  auto comm = communicator(group);
  std::function<void()> copy_back;
  const at::Tensor buf = contiguous(x, &copy_back);
  auto pending =
      comm->broadcast(buf.data_ptr(), static_cast<size_t>(buf.numel()), data_type(buf), root, torch_stream(buf));
  return finisher(std::move(comm), std::move(pending), x.device().index(), {buf}, std::move(copy_back));
}

Finish all_gather(const at::Tensor& o, const at::Tensor& i, int32_t group) {
  auto comm = communicator(group);
  std::function<void()> copy_back;
  const at::Tensor out = contiguous(o, &copy_back);
  const at::Tensor in = (i.scalar_type() == o.scalar_type() ? i : i.to(o.scalar_type())).contiguous();
  auto pending = comm->all_gather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()), data_type(out),
                                  torch_stream(out));
  return finisher(std::move(comm), std::move(pending), o.device().index(), {in, out}, std::move(copy_back));
}

Finish reduce_scatter(const at::Tensor& o, const at::Tensor& i, int32_t group, int32_t op) {
  auto comm = communicator(group);
  std::function<void()> copy_back;
  const at::Tensor out = contiguous(o, &copy_back);
  const at::Tensor in = (i.scalar_type() == o.scalar_type() ? i : i.to(o.scalar_type())).contiguous();
  auto pending = comm->reduce_scatter(in.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()), data_type(out),
                                      reduce_op(op), torch_stream(out));
  return finisher(std::move(comm), std::move(pending), o.device().index(), {in, out}, std::move(copy_back));
}

Finish all_to_all(const at::Tensor& o, const at::Tensor& i, int32_t group, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits) {
  auto comm = communicator(group);
  std::function<void()> copy_back;
  const at::Tensor out = contiguous(o, &copy_back);
  const at::Tensor in = (i.scalar_type() == o.scalar_type() ? i : i.to(o.scalar_type())).contiguous();
  // Rows to elements: every row holds the same number (the trailing dimensions agree).
  int64_t row = 1;
  for (int64_t d = 1; d < o.dim(); ++d) row *= o.size(d);
  std::vector<size_t> in_counts, out_counts;
  for (size_t j = 0; j < in_splits.size(); ++j) {
    in_counts.push_back(static_cast<size_t>(in_splits[j] * row));
    out_counts.push_back(static_cast<size_t>(out_splits[j] * row));
  }
  auto pending =
      comm->all_to_all(in.data_ptr(), out.data_ptr(), in_counts, out_counts, data_type(out), torch_stream(out));
  return finisher(std::move(comm), std::move(pending), o.device().index(), {in, out}, std::move(copy_back));
}

#else  // no CUDA in this build: nothing is ever created

void create(const GroupMembers&, int, const c10::intrusive_ptr<c10d::Store>&, int, std::chrono::milliseconds) {
  throw host::HostError("distributed: backend nccl needs a dtk built with CUDA and NCCL");
}
void release() {}
bool handles(const at::Tensor&, int32_t) { return false; }
Finish all_reduce(const at::Tensor&, int32_t, int32_t) { return {}; }
Finish broadcast(const at::Tensor&, int32_t, int32_t) { return {}; }
Finish all_gather(const at::Tensor&, const at::Tensor&, int32_t) { return {}; }
Finish reduce_scatter(const at::Tensor&, const at::Tensor&, int32_t, int32_t) { return {}; }
Finish all_to_all(const at::Tensor&, const at::Tensor&, int32_t, const std::vector<int64_t>&,
                  const std::vector<int64_t>&) {
  return {};
}

#endif

}  // namespace dtk::core::nccl_backend
