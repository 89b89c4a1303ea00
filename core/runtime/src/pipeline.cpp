// The pretrain pipeline, top to bottom, as Megatron's pretrain():
//   initialize -> setup model, strategy, optimizer -> build data iterators   (Trainer's constructor)
//   -> train loop (micro-batches: forward step + backward; reduce grads; clip; optimizer step;
//      log; periodic evaluation and checkpoint)                               (Trainer::train)
//   -> final evaluation on valid and test                                    (Trainer::final_evaluation)
// The pieces: core/trainer (the loop), core/batch_plan (batch sizes, sampler), core/batch_loader
// (prefetched micro-batches), core/lr_schedule, core/flops, core/training_log (log line,
// TensorBoard), core/checkpoint, core/components (one wrapper per plugin kind).
#include "dtk/core/pipeline.hpp"

#include "dtk/core/distributed.hpp"
#include "dtk/core/trainer.hpp"

namespace dtk::core {

int pretrain(const config::RunConfig& cfg, host::PluginHost& plugins) {
  Trainer trainer(cfg, plugins);
  trainer.train();
  trainer.final_evaluation();
  shutdown_distributed();
  return 0;
}

}  // namespace dtk::core
