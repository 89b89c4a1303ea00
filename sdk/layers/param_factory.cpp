#include <dtk/layers/param_factory.hpp>

#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <limits>
#include <mutex>
#include <vector>

namespace dtk::layers {

at::Tensor ParamFactory::normal(at::IntArrayRef shape, double std) {
  if (deferred) return deferred->record_normal(shape, std, gen);
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  t.normal_(0.0, std, gen);
  return t;
}
at::Tensor ParamFactory::param(const at::Tensor& value) const {
  if (deferred) return deferred->record_param(value, dtype, device);
  return value.to(device, dtype).contiguous().clone().set_requires_grad(true);
}
at::Tensor ParamFactory::zeros(at::IntArrayRef shape) const {
  if (deferred) return deferred->record_fill(shape, 0.0, dtype, device);
  return at::zeros(shape, at::TensorOptions().dtype(dtype).device(device)).set_requires_grad(true);
}
at::Tensor ParamFactory::ones(at::IntArrayRef shape) const {
  if (deferred) return deferred->record_fill(shape, 1.0, dtype, device);
  return at::ones(shape, at::TensorOptions().dtype(dtype).device(device)).set_requires_grad(true);
}

// ---------------------------------------------------------------------------------------------
// A parameter with no values: its shape, dtype and device over one NaN element (a read before the
// values arrive shows), a leaf that requires grad like the real one.
at::Tensor DeferredInit::placeholder(at::IntArrayRef shape, at::ScalarType dtype, at::Device device) {
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  at::Tensor p = at::empty({0}, opts);
  p.set_data(at::full({}, std::numeric_limits<double>::quiet_NaN(), opts).expand(shape));
  return p.set_requires_grad(true);
}

at::Tensor DeferredInit::record_normal(at::IntArrayRef shape, double std, const at::Generator& gen) {
  if (!gen.defined()) throw Error("deferred parameters: ParamFactory::normal needs a generator");
  size_t stream = 0;
  while (stream < streams_.size() && streams_[stream].first != gen) ++stream;
  at::Generator g = gen;
  std::lock_guard<std::mutex> lock(g.mutex());
  if (stream == streams_.size()) {
    // The generator's state now is where its draws start: nothing is drawn from it while deferred.
    streams_.emplace_back(gen, g.clone());
  } else if (!at::equal(g.get_state(), streams_[stream].second.get_state())) {
    // Something drew from it other than normal(): the replay would draw other values.
    throw Error("deferred parameters: the factory's generator was drawn from outside ParamFactory::normal; "
                "a deferred model must draw its weights through the factory only");
  }
  at::Tensor meta = at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
  draws_.push_back(Draw{shape.vec(), std, stream, meta});
  return meta;
}

at::Tensor DeferredInit::record_param(const at::Tensor& value, at::ScalarType dtype, at::Device device) {
  Recorded r;
  if (value.is_meta()) {
    const void* storage = value.storage().unsafeGetStorageImpl();
    // Newest first: a parameter is a view of a master just drawn (a search from the oldest made a
    // deep model's creation quadratic in its layers: minutes at 10^4 layers).
    for (size_t d = draws_.size(); d-- > 0 && r.draw < 0;)
      if (draws_[d].meta.storage().unsafeGetStorageImpl() == storage) r.draw = static_cast<int64_t>(d);
    if (r.draw < 0)
      throw Error("deferred parameters: a parameter must be a master from ParamFactory::normal or a view of one "
                  "(narrow, view, transpose, chunk); this one was computed from masters");
    if (draws_[static_cast<size_t>(r.draw)].meta._version() != 0)
      throw Error("deferred parameters: a master was changed in place after its draw; the replay draws masters "
                  "as drawn (scale the std instead)");
    r.sizes = value.sizes().vec();
    r.strides = value.strides().vec();
    r.storage_offset = value.storage_offset();
  } else {
    r.value = value.detach().to(at::kCPU, at::kFloat).contiguous().clone();
  }
  r.param = placeholder(value.sizes(), dtype, device);
  params_.push_back(r);
  return r.param;
}

at::Tensor DeferredInit::record_fill(at::IntArrayRef shape, double fill, at::ScalarType dtype, at::Device device) {
  Recorded r;
  r.sizes = shape.vec();
  r.fill = fill;
  r.param = placeholder(shape, dtype, device);
  params_.push_back(r);
  return r.param;
}

void DeferredInit::replay(const Take& take) const {
  for (const Recorded& r : params_)
    if (r.draw < 0) take(r.param, r.value.defined() ? r.value : at::full(r.sizes, r.fill, at::kFloat));
  // Each stream from its starting state, draws in construction order: the masters an undeferred
  // build drew. Only one exists at a time.
  std::vector<at::Generator> gens;
  for (const auto& s : streams_) {
    at::Generator start = s.second;
    std::lock_guard<std::mutex> lock(start.mutex());
    gens.push_back(start.clone());
  }
  std::vector<std::vector<const Recorded*>> views_of(draws_.size());
  for (const Recorded& r : params_)
    if (r.draw >= 0) views_of[static_cast<size_t>(r.draw)].push_back(&r);
  for (size_t d = 0; d < draws_.size(); ++d) {
    const Draw& draw = draws_[d];
    at::Tensor master = at::empty(draw.shape, at::TensorOptions().dtype(at::kFloat));
    master.normal_(0.0, draw.std, gens[draw.stream]);
    for (const Recorded* r : views_of[d]) take(r->param, master.as_strided(r->sizes, r->strides, r->storage_offset));
  }
}

}  // namespace dtk::layers
