// dtk/layers/param_factory.hpp — how a model plugin makes its parameters, whole or deferred.
//
// ParamFactory draws every "master" weight in fp32 on the CPU from a seeded generator, in
// construction order, and turns (a slice of) it into a parameter on the run's device: all
// tensor-parallel ranks draw the same master and keep their slice, so a TP=N model is the TP=1
// model cut in pieces (Megatron's CPU initialisation).
//
// Partitioned construction (ABI 2.4, DeepSpeed's zero.Init): when the build context says
// deferred_parameters, the factory is given a DeferredInit. It then draws nothing: a master is a
// meta tensor that records its shape, std and generator, a parameter is a placeholder (its shape,
// dtype and device, one element of storage) that records which view of which master it is. After
// the strategy has laid out its partitions it asks for the values (dtk_model_api.init_parameters):
// DeferredInit replays the draws in the same order from the same generator states, one master at a
// time, and hands each parameter its view, so the values are bit-identical to an undeferred build
// while the whole model never exists anywhere.
#pragma once

#include <dtk/tensor.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dtk::layers {

class DeferredInit;

// How new parameters are made: dtype/device of the parameters, init generator (CPU).
struct ParamFactory {
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  at::Generator gen;  // CPU generator used for every master weight, in construction order
  // Set: parameters are placeholders whose values DeferredInit::replay gives later.
  DeferredInit* deferred = nullptr;

  // A normal(0, std) master weight of `shape`, drawn in fp32 on the CPU (deferred: a meta tensor).
  at::Tensor normal(at::IntArrayRef shape, double std);
  // Turns a (view of a) master tensor into a trainable parameter. Deferred, `value` must be a
  // master from normal() or a view of one (narrow, select, view, transpose, chunk), or a CPU tensor.
  at::Tensor param(const at::Tensor& value) const;
  at::Tensor zeros(at::IntArrayRef shape) const;
  at::Tensor ones(at::IntArrayRef shape) const;
};

// The recorded construction of a deferred model, and its replay.
class DeferredInit {
 public:
  // `value` is a parameter's initial value: CPU, fp32, the parameter's shape.
  using Take = std::function<void(const at::Tensor& param, const at::Tensor& value)>;

  // What ParamFactory calls in deferred mode.
  at::Tensor record_normal(at::IntArrayRef shape, double std, const at::Generator& gen);
  at::Tensor record_param(const at::Tensor& value, at::ScalarType dtype, at::Device device);
  at::Tensor record_fill(at::IntArrayRef shape, double fill, at::ScalarType dtype, at::Device device);

  // Every recorded parameter's value, in construction order, one master at a time. `param` is the
  // placeholder the factory returned (the model's tensor, whatever set_data did to it since).
  void replay(const Take& take) const;
  size_t num_params() const { return params_.size(); }

 private:
  struct Draw {
    std::vector<int64_t> shape;
    double std;
    size_t stream;    // index into streams_
    at::Tensor meta;  // the master handed to the model: views of it share its storage
  };
  struct Recorded {
    at::Tensor param;  // the placeholder (its TensorImpl is the model's parameter)
    int64_t draw = -1;  // >= 0: a view of draws_[draw]
    std::vector<int64_t> sizes, strides;
    int64_t storage_offset = 0;
    at::Tensor value;  // draw < 0: the value itself (a CPU tensor), or undefined for a fill
    double fill = 0.0;  // a fill of `sizes`
  };
  at::Tensor placeholder(at::IntArrayRef shape, at::ScalarType dtype, at::Device device);
  std::vector<std::pair<at::Generator, at::Generator>> streams_;  // (the model's, a copy of its start)
  std::vector<Draw> draws_;
  std::vector<Recorded> params_;
};

}  // namespace dtk::layers
