// dtk/capture.hpp — what a layer needs to know when the host records the training step into a
// CUDA graph (train.cuda_graphs): the host's dtk.ext.capture.v1 extension (abi.h). While the step
// is recorded its kernels are enqueued, not run, so a host read of a device value (.item(), a copy
// to the CPU, nonzero) would fail the capture, and a branch on one would be frozen into the graph.
//
//   dtk::defer_check(ids.ge(limit).any(), "my_model: token ids outside the vocabulary");
//   // recording: the host reads the flag after the backward; otherwise: read and thrown now
//
// Dropout masks drawn while recording take their seeds from slots the host fills before each
// replay (seed_slot, ABI 2.6): dtk::layers::draw_keep_mask does that itself.
//
// Without the extension (an older host, or no host: a unit test) nothing is ever captured and
// defer_check checks at once.
#pragma once

#include <dtk/tensor.hpp>

#include <string>

namespace dtk {

// The host's capture table, or nullptr (looked up once per plugin).
inline const dtk_capture_ext* capture_extension() {
  static const dtk_capture_ext* ext = [] {
    const dtk_host_services* h = host_services();
    if (!h || !h->get_extension) return static_cast<const dtk_capture_ext*>(nullptr);
    const auto* e = static_cast<const dtk_capture_ext*>(h->get_extension(DTK_EXT_CAPTURE_V1));
    return e && e->struct_size >= dtk_capture_ext_STRUCT_SIZE_2_5 ? e : nullptr;
  }();
  return ext;
}

// True while the host records the step on this thread: take the path with no host read.
inline bool capturing() {
  const dtk_capture_ext* e = capture_extension();
  return e && e->capturing() != 0;
}

// Which pass over the step's body is under way while capturing() (dtk_capture_ext.recording_id,
// ABI 2.6): it changes with each recording, and with each replay that runs the body again (the CPU
// probe). 0 otherwise, and with an older host.
inline int64_t recording_id() {
  const dtk_capture_ext* e = capture_extension();
  return e && e->struct_size >= dtk_capture_ext_STRUCT_SIZE_2_6 ? e->recording_id() : 0;
}

// `failed` (a bool tensor; true anywhere = failed). While the host records the step it reads the
// flag once per iteration, before the optimizer step, and then stops the run with `message`;
// otherwise it is read now and `message` thrown.
inline void defer_check(const at::Tensor& failed, const std::string& message) {
  if (capturing()) {
    capture_extension()->defer_check(wrap(failed.detach()), message.c_str());
    return;
  }
  if (failed.numel() > 0 && failed.any().item<bool>()) throw Error(message);
}

}  // namespace dtk
