// recorded_seeds.cpp — see recorded_seeds.hpp.
#include "recorded_seeds.hpp"

#include <dtk/capture.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace dtk::layers::recorded_seeds {
namespace {

// One generator's draws in the recording under way.
struct Stream {
  at::Generator keep;             // held until the next recording, so its address names it
  c10::GeneratorImpl* root;       // the generator that really draws: itself, or a clone's source
  size_t next = 0;                // position of this generator's next draw among root's draws
  std::vector<at::Tensor> slots;  // a root's: the slot of each of its positions handed out so far
};

struct Book {
  std::mutex mu;  // the backward's recomputation draws on autograd's threads
  int64_t recording = 0;
  std::unordered_map<c10::GeneratorImpl*, Stream> streams;
};

Book& book() {
  static Book b;
  return b;
}

// A new recording starts with no streams.
void follow_recording(Book& b) {
  const int64_t id = recording_id();
  if (id == b.recording) return;
  b.streams.clear();
  b.recording = id;
}

Stream& stream_of(Book& b, at::Generator& gen) {
  c10::GeneratorImpl* impl = gen.unsafeGetGeneratorImpl();
  auto it = b.streams.find(impl);
  if (it != b.streams.end()) return it->second;
  Stream s;
  s.keep = gen;
  s.root = impl;
  return b.streams.emplace(impl, std::move(s)).first->second;
}

// The host's callbacks (they must not throw): ctx is a heap copy of the root generator's handle,
// a CPU generator (next() checked it).
uint64_t draw_seed(void* ctx) noexcept {
  at::Generator& gen = *static_cast<at::Generator*>(ctx);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return static_cast<at::CPUGeneratorImpl*>(gen.unsafeGetGeneratorImpl())->random64();
}
void release_generator(void* ctx) noexcept { delete static_cast<at::Generator*>(ctx); }

}  // namespace

bool available() { return capture_extension() && capture_extension()->struct_size >= dtk_capture_ext_STRUCT_SIZE_2_6; }

at::Tensor next(at::Generator& gen) {
  if (!available()) throw Error("dropout: recording the step needs a host of ABI 2.6 or later, which draws its seeds");
  Book& b = book();
  std::lock_guard<std::mutex> lock(b.mu);
  follow_recording(b);
  Stream& s = stream_of(b, gen);
  Stream& root = b.streams.at(s.root);
  const size_t position = s.next;
  if (s.root != gen.unsafeGetGeneratorImpl()) {
    // A clone repeats draws its source made: one past them would draw the source on every replay
    // where an uncaptured run would not, and leave its generator elsewhere.
    if (position >= root.slots.size())
      throw Error("dropout: a recomputed layer drew a mask its forward did not, which a recorded step cannot repeat");
    ++s.next;
    return root.slots[position];
  }
  // A root: only its own draws add slots, so this is its next position. The host draws the slots
  // in the order they are handed out: the root's draws in order, those of an uncaptured micro-batch.
  at::check_generator<at::CPUGeneratorImpl>(gen);  // as an uncaptured draw checks
  dtk_tensor* slot = capture_extension()->seed_slot(&draw_seed, new at::Generator(root.keep), &release_generator);
  if (!slot) throw Error("dropout: the recorded step holds more masks than the host keeps seeds for");
  TensorHandle owned(slot);
  root.slots.push_back(unwrap(slot));
  ++s.next;
  return root.slots.back();
}

void note_clone(at::Generator& source, at::Generator& copy) {
  Book& b = book();
  std::lock_guard<std::mutex> lock(b.mu);
  follow_recording(b);
  const Stream& src = stream_of(b, source);
  Stream c;
  c.keep = copy;
  c.root = src.root;
  c.next = src.next;
  b.streams.insert_or_assign(copy.unsafeGetGeneratorImpl(), std::move(c));
}

}  // namespace dtk::layers::recorded_seeds
