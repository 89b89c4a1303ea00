// The plugin contracts (docs/plugin-guide.md, "Contracts", issue 19 items 3 and 4): a plugin that
// breaks one is stopped with one `dtk: error:` line that names it (and the step that called a
// failing model), before its mistake can train silently or surface as a bare LibTorch message.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "../common/run_dtk.hpp"

namespace {

using dtk_test::expect_one_line_error;
using dtk_test::run_dtk;

// contract_model + contract_data (vocab 64) with the shipped causal_lm step.
std::string train(const std::string& extra) {
  return std::string("train --config ") + DTK_SOURCE_DIR + "/configs/gpt-tiny.pbtxt --model contract_model " +
         "--dataset contract_data --plugin_path " + DTK_CONTRACT_PLUGIN_DIR + " --threads 1 " +
         "--set train.seq_length=16 --set train.micro_batch_size=4 --set train.global_batch_size=4 " +
         "--set train.train_iters=6 --set lr.lr_warmup_iters=1 --set eval.eval_iters=0 --set logging.log_interval=1 " +
         extra;
}

TEST(Contracts, AModelKeepingEveryRuleTrains) {
  const auto r = run_dtk(train(""));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("iteration        6/       6"), std::string::npos) << r.out;
}

TEST(Contracts, ADetachedModelOutputIsBlamedOnTheModel) {
  expect_one_line_error(run_dtk(train("--set model.fault=detached")),
                        "model plugin 'contract_model': forward returned outputs that do not require grad");
}

TEST(Contracts, ADetachedLossIsBlamedOnTheStep) {
  expect_one_line_error(run_dtk(train("--step detaching_step")),
                        "step plugin 'detaching_step': forward_step returned a loss that does not require grad");
}

// train.calculate_per_token_loss needs a step that sums its loss (ABI 2.8): one that cannot is
// named before its mean trains as if it were a sum.
TEST(Contracts, AStepThatCannotSumItsLossIsRefusedForAPerTokenLoss) {
  expect_one_line_error(run_dtk(train("--step detaching_step --set train.calculate_per_token_loss=true")),
                        "step plugin 'detaching_step' returned no token count with its loss");
}

TEST(Contracts, ATrainedTensorMissingFromTheParametersIsRefused) {
  expect_one_line_error(run_dtk(train("--set model.fault=unlisted")),
                        "model plugin 'contract_model': 1 tensor the loss trains is not listed by visit_parameters "
                        "(the first: Float [16])");
}

// Each parameter once: a tensor listed twice would be stepped and counted twice; two under
// one name would meet in a checkpoint. Refused when the model is created, whatever the strategy.
TEST(Contracts, AParameterListedTwiceIsRefused) {
  for (const char* strategy : {"ddp", "zero"}) {
    const std::string with = std::string(" --strategy ") + strategy;
    expect_one_line_error(run_dtk(train("--set model.fault=listed_twice" + with)),
                          "model plugin 'contract_model': visit_parameters lists one tensor twice, as 'head' and "
                          "'head_again': list each parameter once");
    expect_one_line_error(run_dtk(train("--set model.fault=same_name" + with)),
                          "model plugin 'contract_model': visit_parameters lists two parameters named 'embedding'");
  }
}

TEST(Contracts, AnErrorInTheModelsForwardNamesTheModelAndTheStep) {
  expect_one_line_error(run_dtk(train("--set model.fault=throw_forward")),
                        "step plugin 'causal_lm': forward_step: model plugin 'contract_model': forward: boom in forward");
}

TEST(Contracts, AnErrorInTheModelsBackwardNamesTheModelAndTheStep) {
  expect_one_line_error(
      run_dtk(train("--set model.fault=throw_backward")),
      "backward of the loss of step plugin 'causal_lm' through model plugin 'contract_model' failed: boom in backward");
}

TEST(Contracts, SamplesOneTokenShortAreBlamedOnTheDataset) {
  expect_one_line_error(run_dtk(train("--set dataset.short_samples=true")),
                        "dataset plugin 'contract_data': samples of 'text' hold 16 tokens, the run needs "
                        "seq_length + 1 = 17");
}

// Sample 16 is the first of iteration 5, past the checked first batches: by default the model
// meets the bad id (and is named); with train.check_every_batch the dataset is named.
TEST(Contracts, ALateOutOfRangeTokenIsFoundWhereItIsChecked) {
  expect_one_line_error(run_dtk(train("--set dataset.bad_id_from=16")),
                        "step plugin 'causal_lm': forward_step: model plugin 'contract_model': forward: ");
  expect_one_line_error(run_dtk(train("--set dataset.bad_id_from=16 --set train.check_every_batch=true")),
                        "dataset plugin 'contract_data': token id 64 in 'text' of a training batch of iteration 5 "
                        "is not below the vocabulary the dataset declares of 64 tokens");
}

}  // namespace

// A model that does not report dtk_model_info.sequence_parallel would train plain TP under the
// flag (or send whole sequences between pipeline stages): refused at start, naming it.
TEST(Contracts, AModelWithoutSequenceParallelismIsRefusedUnderIt) {
  const auto r = run_dtk("launch --nproc_per_node 2 " +
                         train("--set distributed.tensor_model_parallel_size=2 --set distributed.sequence_parallel=true"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("model plugin 'contract_model' does not run sequence parallelism (its dtk_model_info"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

// A model that does not report dtk_model_info.context_parallel (ABI 2.20) would attend within each
// rank's share of the sequence only: refused at start, naming it.
TEST(Contracts, AModelWithoutContextParallelismIsRefusedUnderIt) {
  const auto r = run_dtk("launch --nproc_per_node 2 " + train("--set distributed.context_parallel_size=2"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("model plugin 'contract_model' does not run context parallelism (its dtk_model_info"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

// A model that runs only the all-to-all exchange (dtk_model_info.context_parallel 1, what a 2.20
// model reports) would be handed all_gather's layout: refused at start, naming it (ABI 2.21).
TEST(Contracts, AModelWithoutTheAllGatherExchangeIsRefusedUnderIt) {
  const auto r = run_dtk("launch --nproc_per_node 2 " +
                         train("--set distributed.context_parallel_size=2 --set distributed.cp_comm_type=all_gather "
                               "--set model.context_parallel=1"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("model plugin 'contract_model' does not run distributed.cp_comm_type all_gather (its "
                       "dtk_model_info.context_parallel lacks that exchange's bit"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
  // And one that runs all_gather alone (bit 2) under the default a2a.
  const auto a2a = run_dtk("launch --nproc_per_node 2 " +
                           train("--set distributed.context_parallel_size=2 --set model.context_parallel=2"));
  EXPECT_NE(a2a.code, 0) << a2a.out;
  EXPECT_NE(a2a.out.find("does not run distributed.cp_comm_type a2a (its dtk_model_info.context_parallel lacks"),
            std::string::npos)
      << a2a.out;
}

// A model that does not report dtk_model_info.pipeline_split would build its even share of the
// layers under an uneven split: refused at start, naming it.
TEST(Contracts, AModelWithoutThePipelineSplitIsRefusedUnderAnUnevenOne) {
  const auto r = run_dtk("launch --nproc_per_node 2 " + train("--set distributed.pipeline_model_parallel_size=2 "
                                                              "--set distributed.decoder_first_pipeline_num_layers=1"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("model plugin 'contract_model' builds only the even split of its layers over the pipeline "
                       "stages (its dtk_model_info.pipeline_split is 0)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

// Nor does `dtk checkpoint convert` cut such a model's checkpoint into an uneven split (it would
// build its even share and be named by the uneven one's layers).
TEST(Contracts, AModelWithoutThePipelineSplitIsNotConvertedIntoOne) {
  const std::string dir = std::string(DTK_TEST_TMP) + "/contract-ckpt";
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir + "-uneven");
  const auto saved = run_dtk(train("--set checkpoint.save=" + dir));
  ASSERT_EQ(saved.code, 0) << saved.out;
  const auto r = run_dtk("checkpoint convert " + dir + " " + dir + "-uneven --plugin_path " + DTK_CONTRACT_PLUGIN_DIR +
                         " --pipeline_model_parallel_size 2 --decoder_first_pipeline_num_layers 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("dtk: error: checkpoint convert: the model plugin builds only the even split of its layers over "
                       "the pipeline stages (its dtk_model_info.pipeline_split is 0), and the new layout asks for 1 "
                       "layer on the first pipeline rank"),
            std::string::npos)
      << r.out;
}
