#include "dtk/core/config/config.hpp"
#include "dtk/core/config/param_rule_regex.hpp"
#include "dtk/core/device/cuda_support.hpp"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>
#include <vector>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/config/curriculum.hpp"
#include "dtk/core/timeline/op_profile.hpp"
#include "dtk/core/timeline/trace.hpp"
#include "dtk/host/plugin_host.hpp"  // HostError, did_you_mean

namespace dtk::core {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using google::protobuf::TextFormat;
using host::HostError;

namespace {

constexpr const char* kDefaults = R"pb(
  model { name: "gpt" }
  dataset { name: "synthetic" }
  step { name: "causal_lm" }
  optimizer { name: "adamw" }
  strategy { name: "ddp" }
  train {
    micro_batch_size: 4
    global_batch_size: 0
    train_iters: 100
    seq_length: 128
    seed: 1234
    clip_grad: 1.0
    params_dtype: "fp32"
    threads: 0
    device: "cpu"
  }
  lr { lr: 3e-4 min_lr: 3e-5 lr_decay_style: "cosine" lr_warmup_iters: 0 lr_decay_iters: 0 weight_decay: 0.01 }
  eval { eval_interval: 0 eval_iters: 10 }
  logging { log_interval: 10 }
  distributed { tensor_model_parallel_size: 1 pipeline_model_parallel_size: 1 backend: "gloo" timeout_seconds: 300 }
)pb";

// Collects the first parse error as "line L column C: message".
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (text.empty())
      text = "line " + std::to_string(line + 1) + " column " + std::to_string(column + 1) + ": " + message;
  }
  void AddWarning(int, int, const std::string&) override {}
  std::string text;
};

// A plugin option given twice in one text: the options map would keep the last without a word.
void refuse_repeated_options(const std::string& text, const std::string& origin) {
  config::RunConfigSlotsText slots;
  TextFormat::Parser parser;
  parser.AllowUnknownField(true);
  FirstError quiet;  // the real parse reports what does not parse
  parser.RecordErrorsTo(&quiet);
  if (!parser.ParseFromString(text, &slots)) return;
  const std::pair<const char*, const config::PluginChoiceText*> choices[] = {{"model", &slots.model()},
                                                                             {"dataset", &slots.dataset()},
                                                                             {"step", &slots.step()},
                                                                             {"optimizer", &slots.optimizer()},
                                                                             {"strategy", &slots.strategy()}};
  for (const auto& [slot, choice] : choices) {
    std::set<std::string> seen;
    for (const auto& option : choice->options())
      if (!seen.insert(option.key()).second)
        throw HostError(origin + ": " + slot + " option '" + option.key() + "' is given twice (\"" + option.value() +
                        "\" the second time): give it once");
  }
}

void merge_text(const std::string& text, config::RunConfig* cfg, const std::string& origin) {
  TextFormat::Parser parser;
  FirstError errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.MergeFromString(text, cfg))
    throw HostError(origin + ": " + (errors.text.empty() ? "parse error" : errors.text));
  refuse_repeated_options(text, origin);
}

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  std::string p;
  while (std::getline(ss, p, '.')) parts.push_back(p);
  return parts;
}

std::vector<std::string> field_names(const Descriptor* d, const std::string& prefix) {
  std::vector<std::string> out;
  for (int i = 0; i < d->field_count(); ++i) out.push_back(prefix + d->field(i)->name());
  return out;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

RampUp parse_rampup(const std::string& text) {
  std::istringstream in(text);
  RampUp r;
  std::string rest;
  if (!(in >> r.start >> r.increment >> r.samples) || (in >> rest) || r.start <= 0 || r.increment <= 0 ||
      r.samples <= 0)
    throw HostError("config: train.rampup_batch_size '" + text +
                    "' is not 'START INCREMENT SAMPLES' (three positive whole numbers; e.g. '16 16 5859375')");
  return r;
}

namespace {

// Megatron's _parse_numeric_value: a decimal with an optional K, M, B or T (either case), as
// int(float(x) * multiplier) computes it (the product rounded as a double, then truncated toward
// zero, so -0.5 is 0). Python's float takes digit-grouping underscores too; a value beyond int64
// is taken as int64's largest (a threshold never reached, a batch refused as too large).
int64_t schedule_number(std::string text, const std::string& entry) {
  const auto bad = [&](const std::string& why) {
    return HostError("config: train.step_batch_size_schedule entry '" + entry + "': " + why);
  };
  double multiplier = 1;
  if (!text.empty()) {
    switch (std::toupper(static_cast<unsigned char>(text.back()))) {
      case 'T':
        multiplier = 1e12;
        break;
      case 'B':
        multiplier = 1e9;
        break;
      case 'M':
        multiplier = 1e6;
        break;
      case 'K':
        multiplier = 1e3;
        break;
      default:
        break;
    }
    if (multiplier != 1) text.pop_back();
  }
  text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
  const bool decimal = !text.empty() && text.find_first_not_of("0123456789.eE+-") == std::string::npos;
  char* end = nullptr;
  const double v = decimal ? std::strtod(text.c_str(), &end) : 0;
  if (!decimal || end != text.c_str() + text.size() || !std::isfinite(v))
    throw bad("'" + text + "' is not a number (a decimal with an optional K, M, B or T: 2.4B)");
  const double product = std::trunc(v * multiplier);
  if (product < 0) throw bad("a threshold or batch must be >= 0");
  return product >= 9.2e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(product);
}

}  // namespace

std::vector<BatchStep> parse_step_batch_schedule(const std::string& text, int64_t seq_length) {
  std::string spaced = text;
  std::replace(spaced.begin(), spaced.end(), ',', ' ');
  std::istringstream in(spaced);
  std::vector<BatchStep> steps;
  for (std::string entry; in >> entry;) {
    const size_t colon = entry.find(':');
    if (colon == std::string::npos)
      throw HostError("config: train.step_batch_size_schedule entry '" + entry + "' is not THRESHOLD:BATCH");
    BatchStep s;
    s.entry = entry;
    s.first_sample = schedule_number(entry.substr(0, colon), entry) / std::max<int64_t>(1, seq_length);
    s.batch = schedule_number(entry.substr(colon + 1), entry);
    if (s.batch <= 0)
      throw HostError("config: train.step_batch_size_schedule entry '" + entry + "': the batch must be positive");
    steps.push_back(s);
  }
  if (steps.empty())
    throw HostError("config: train.step_batch_size_schedule '" + text +
                    "' has no entry (THRESHOLD:BATCH pairs, e.g. '0:16 2.4B:320 4.8B:624')");
  std::stable_sort(steps.begin(), steps.end(),
                   [](const BatchStep& a, const BatchStep& b) { return a.first_sample < b.first_sample; });
  if (steps.front().first_sample != 0)
    throw HostError("config: train.step_batch_size_schedule: the first threshold must be 0, got '" +
                    steps.front().entry + "' (sample " + std::to_string(steps.front().first_sample) + " at " +
                    std::to_string(seq_length) + " tokens a sample)");
  for (size_t k = 1; k < steps.size(); ++k)
    if (steps[k].first_sample == steps[k - 1].first_sample)
      throw HostError("config: train.step_batch_size_schedule: '" + steps[k - 1].entry + "' and '" + steps[k].entry +
                      "' fall on the same sample (" + std::to_string(steps[k].first_sample) +
                      "; thresholds are tokens, " + std::to_string(seq_length) +
                      " a sample): thresholds must increase");
  return steps;
}

config::RunConfig default_config() {
  config::RunConfig cfg;
  merge_text(kDefaults, &cfg, "built-in defaults");
  return cfg;
}

config::RunConfig load_config(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw HostError("config '" + path + "': no such file");
  if (!std::filesystem::is_regular_file(path, ec)) throw HostError("config '" + path + "': not a regular file");
  std::ifstream in(path);
  if (!in) throw HostError("config '" + path + "': cannot open file");
  std::stringstream ss;
  ss << in.rdbuf();
  // The file alone first: a field set twice in it is a mistake (merging would keep the last).
  {
    config::RunConfig alone;
    TextFormat::Parser parser;
    FirstError errors;
    parser.RecordErrorsTo(&errors);
    if (!parser.ParseFromString(ss.str(), &alone))
      throw HostError("config '" + path + "': " + (errors.text.empty() ? "parse error" : errors.text));
    // An empty file (or only comments) is almost always the wrong file or a failed write: running
    // the defaults under its name would hide that.
    if (alone.ByteSizeLong() == 0)
      throw HostError("config '" + path + "': sets nothing (empty or only comments); drop --config for the defaults");
  }
  config::RunConfig cfg = default_config();
  merge_text(ss.str(), &cfg, "config '" + path + "'");
  return cfg;
}

namespace {

// A list of sections (lr.param_rules): each --set appends one entry, written in text format with
// or without braces ('match: "bias$" wd_mult: 0').
void append_section_entry(Message* msg, const FieldDescriptor* f, const std::string& assignment,
                          const std::string& path, const std::string& value) {
  std::string body = value;
  const size_t first = body.find_first_not_of(" \t");
  const size_t last = body.find_last_not_of(" \t");
  if (first != std::string::npos && body[first] == '{' && body[last] == '}')
    body = body.substr(first + 1, last - first - 1);
  std::unique_ptr<Message> entry(msg->GetReflection()->GetMessageFactory()->GetPrototype(f->message_type())->New());
  TextFormat::Parser parser;
  FirstError errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(body, entry.get()))
    throw HostError("--set '" + assignment + "': not a valid " + f->message_type()->name() + " entry (" +
                    (errors.text.empty() ? "parse error" : errors.text) + ")" +
                    (f->message_type()->name() == "ParamRule"
                         ? "; e.g. --set '" + path + "=match: \"bias$\" wd_mult: 0'"
                     : f->message_type()->name() == "ValidationSet"
                         ? "; e.g. --set '" + path +
                               "=name: \"wiki\" options { key: \"valid_data_path\" value: \"wiki_text_document\" }'"
                         : std::string()));
  msg->GetReflection()->AddMessage(msg, f)->CopyFrom(*entry);
}

// MergeFrom skips proto3 zero values; copy explicitly so "--set train.clip_grad=0" works.
void copy_scalar(Message* msg, const FieldDescriptor* f, const Message& from) {
  const Reflection* r = msg->GetReflection();
  const Reflection* fr = from.GetReflection();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      r->SetInt32(msg, f, fr->GetInt32(from, f));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      r->SetInt64(msg, f, fr->GetInt64(from, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      r->SetUInt32(msg, f, fr->GetUInt32(from, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      r->SetUInt64(msg, f, fr->GetUInt64(from, f));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      r->SetDouble(msg, f, fr->GetDouble(from, f));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      r->SetFloat(msg, f, fr->GetFloat(from, f));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      r->SetBool(msg, f, fr->GetBool(from, f));
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      r->SetString(msg, f, fr->GetString(from, f));
      break;
    default:
      break;
  }
}

// A scalar field: the text-format parser does the type checking and conversion.
void set_scalar(Message* msg, const FieldDescriptor* f, const std::string& assignment, const std::string& path,
                const std::string& value) {
  const std::string literal = f->type() == FieldDescriptor::TYPE_STRING ? "\"" + escape(value) + "\"" : value;
  TextFormat::Parser parser;
  FirstError errors;
  parser.RecordErrorsTo(&errors);
  std::unique_ptr<Message> tmp(msg->New());
  if (value.empty() && f->type() != FieldDescriptor::TYPE_STRING)
    throw HostError("--set '" + assignment + "': empty value for '" + path + "'");
  if (!parser.ParseFieldValueFromString(literal, f, tmp.get()))
    throw HostError("--set '" + assignment + "': '" + value + "' is not a valid " + f->type_name() + " for '" + path +
                    "'");
  msg->GetReflection()->ClearField(msg, f);
  msg->MergeFrom(*tmp);
  copy_scalar(msg, f, *tmp);
}

[[noreturn]] void throw_no_field(const Descriptor* d, const std::string& assignment, const std::string& walked,
                                 const std::string& name) {
  std::string msg_text = "--set '" + assignment + "': no config field '" + walked + name + "'";
  std::string guess = host::did_you_mean(name, field_names(d, ""));
  if (!guess.empty()) msg_text += "; did you mean '" + walked + guess + "'?";
  throw HostError(msg_text);
}

}  // namespace

// Walks the dotted path section by section; the last part is a plugin option, a list entry or a
// scalar field.
void apply_override(config::RunConfig& cfg, const std::string& assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw HostError("--set '" + assignment + "': expected key=value (e.g. lr.lr=3e-4)");
  const std::string path = assignment.substr(0, eq);
  const std::string value = assignment.substr(eq + 1);
  const auto parts = split_path(path);

  Message* msg = &cfg;
  std::string walked;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Descriptor* d = msg->GetDescriptor();
    const FieldDescriptor* f = d->FindFieldByName(parts[i]);
    const bool last = i + 1 == parts.size();
    if (!f && d->full_name() == "dtk.config.PluginChoice" && last) {
      // Below a plugin slot, an unknown name is a plugin option; the host validates it against
      // the plugin's declarations once the plugin is known.
      auto* choice = static_cast<config::PluginChoice*>(msg);
      (*choice->mutable_options())[parts[i]] = value;
      return;
    }
    if (f && f->is_repeated() && !f->is_map() && f->type() == FieldDescriptor::TYPE_MESSAGE && last)
      return append_section_entry(msg, f, assignment, path, value);
    if (!f || f->is_map() || f->is_repeated()) throw_no_field(d, assignment, walked, parts[i]);
    if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
      if (last) throw HostError("--set '" + assignment + "': '" + path + "' is a section, name one of its fields");
      msg = msg->GetReflection()->MutableMessage(msg, f);
      walked += parts[i] + ".";
      continue;
    }
    if (!last) throw HostError("--set '" + assignment + "': '" + walked + parts[i] + "' is not a section");
    return set_scalar(msg, f, assignment, path, value);
  }
}

std::string config_value(const config::RunConfig& cfg, const std::string& path) {
  const auto parts = split_path(path);
  const Message* msg = &cfg;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Descriptor* d = msg->GetDescriptor();
    const FieldDescriptor* f = d->FindFieldByName(parts[i]);
    if (!f && d->full_name() == "dtk.config.PluginChoice" && i + 1 == parts.size()) {
      const auto& opts = static_cast<const config::PluginChoice*>(msg)->options();
      auto it = opts.find(parts[i]);
      if (it != opts.end()) return it->second;
    }
    if (!f) throw HostError("no config field '" + path + "'");
    if (f->is_repeated())
      throw HostError("config field '" + path + "' is a map; ask for one entry (e.g. model.num_layers)");
    const Reflection* r = msg->GetReflection();
    if (f->type() == FieldDescriptor::TYPE_MESSAGE && !f->is_repeated()) {
      msg = &r->GetMessage(*msg, f);
      if (i + 1 == parts.size()) {
        std::string out;
        TextFormat::PrintToString(*msg, &out);
        return out;
      }
      continue;
    }
    if (i + 1 != parts.size()) throw HostError("no config field '" + path + "'");
    std::string out;
    TextFormat::PrintFieldValueToString(*msg, f, -1, &out);
    if (f->type() == FieldDescriptor::TYPE_STRING) {
      out = r->GetString(*msg, f);  // unquoted
    }
    return out;
  }
  throw HostError("no config field '" + path + "'");
}

namespace {

// Megatron's rules for --weight-decay-incr-style: constant uses weight_decay and takes no ends;
// linear and cosine need both ends, 0 <= start <= end.
void validate_weight_decay(const config::LrSchedule& lr) {
  const std::string& style = lr.weight_decay_incr_style();
  if (!style.empty() && style != "constant" && style != "linear" && style != "cosine")
    throw HostError("config: lr.weight_decay_incr_style must be constant, linear or cosine, got '" + style + "'");
  if (!std::isfinite(lr.weight_decay()) || lr.weight_decay() < 0)
    throw HostError("config: lr.weight_decay must be a finite number >= 0");
  if (style.empty() || style == "constant") {
    if (lr.has_start_weight_decay() || lr.has_end_weight_decay())
      throw HostError(
          "config: lr.start_weight_decay and lr.end_weight_decay need lr.weight_decay_incr_style linear or cosine "
          "(a constant schedule uses lr.weight_decay)");
  } else {
    if (!lr.has_start_weight_decay() || !lr.has_end_weight_decay())
      throw HostError("config: lr.weight_decay_incr_style=" + style +
                      " needs lr.start_weight_decay and lr.end_weight_decay");
    if (!std::isfinite(lr.start_weight_decay()) || !std::isfinite(lr.end_weight_decay()) ||
        lr.start_weight_decay() < 0 || lr.end_weight_decay() < lr.start_weight_decay())
      throw HostError("config: lr.start_weight_decay and lr.end_weight_decay must be finite with 0 <= start <= end, got " +
                      std::to_string(lr.start_weight_decay()) + " and " + std::to_string(lr.end_weight_decay()));
  }
  for (int i = 0; i < lr.param_rules_size(); ++i) {
    const auto& r = lr.param_rules(i);
    const std::string which = "config: lr.param_rules[" + std::to_string(i) + "]";
    if (r.match().empty()) throw HostError(which + ": 'match' (a regular expression) is empty");
    try {
      param_rule_regex(r.match());
    } catch (const std::regex_error& e) {
      throw HostError(which + ": 'match' \"" + r.match() + "\" is not a valid regular expression (" + e.what() + ")");
    }
    if (r.has_lr_mult() && (!std::isfinite(r.lr_mult()) || r.lr_mult() < 0))
      throw HostError(which + ": lr_mult must be a finite number >= 0");
    if (r.has_wd_mult() && (!std::isfinite(r.wd_mult()) || r.wd_mult() < 0))
      throw HostError(which + ": wd_mult must be a finite number >= 0");
    for (const auto& [name, has, value] :
         {std::tuple{"max_lr", r.has_max_lr(), r.max_lr()}, std::tuple{"min_lr", r.has_min_lr(), r.min_lr()}})
      if (has && (!std::isfinite(value) || value < 0))
        throw HostError(which + ": " + name + " must be a finite number >= 0");
    const bool own_schedule = r.has_max_lr() || r.has_min_lr();
    const double peak = r.has_max_lr() ? r.max_lr() : lr.lr(), floor = r.has_min_lr() ? r.min_lr() : lr.min_lr();
    if (own_schedule && floor > peak) {
      char text[128];
      std::snprintf(text, sizeof text, ": min_lr %g (%s) is above max_lr %g (%s)", floor,
                    r.has_min_lr() ? "the rule's" : "lr.min_lr", peak, r.has_max_lr() ? "the rule's" : "lr.lr");
      throw HostError(which + text + ": its rate would rise while it decays");
    }
    if (own_schedule && is_deepspeed_style(lr.lr_decay_style()))
      throw HostError(which + ": max_lr and min_lr follow Megatron's schedules; DeepSpeed's " + lr.lr_decay_style() +
                      " has one schedule for every group (use lr_mult)");
    if (r.has_max_lr() && lr.lr_warmup_init() > r.max_lr()) {
      char text[128];
      std::snprintf(text, sizeof text, ": lr.lr_warmup_init %g is above its max_lr %g", lr.lr_warmup_init(),
                    r.max_lr());
      throw HostError(which + text + ": its warm-up would fall");
    }
  }
}

}  // namespace

namespace {

// Every floating-point field of the config, anywhere: a NaN or an infinity is never a valid
// rate, decay, clip, scale, duration or peak (`--set lr.lr=nan` trained and skipped every step).
void require_finite_numbers(const Message& msg, const std::string& prefix) {
  const Descriptor* d = msg.GetDescriptor();
  const Reflection* r = msg.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const std::string path = prefix + f->name();
    if (f->type() == FieldDescriptor::TYPE_MESSAGE && !f->is_map()) {
      if (f->is_repeated()) {
        for (int k = 0; k < r->FieldSize(msg, f); ++k)
          require_finite_numbers(r->GetRepeatedMessage(msg, f, k), path + "[" + std::to_string(k) + "].");
      } else if (r->HasField(msg, f)) {
        require_finite_numbers(r->GetMessage(msg, f), path + ".");
      }
      continue;
    }
    if (f->is_repeated()) continue;
    double v = 0;
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_DOUBLE)
      v = r->GetDouble(msg, f);
    else if (f->cpp_type() == FieldDescriptor::CPPTYPE_FLOAT)
      v = r->GetFloat(msg, f);
    else
      continue;
    if (!std::isfinite(v))
      throw HostError("config: " + path + " must be a finite number, got " + (std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"));
  }
}

}  // namespace

namespace {

void require_positive(int64_t v, const char* name) {
  if (v <= 0) throw HostError(std::string("config: ") + name + " must be positive, got " + std::to_string(v));
}

// The numbers as the user wrote them ("0" and "-3", not std::to_string's "0.000000").
std::string shortest(double v) {
  char text[40];
  std::snprintf(text, sizeof text, "%.15g", v);
  return text;
}

void require_finite_at_least(double v, double lo, const char* name) {
  if (!std::isfinite(v) || v < lo)
    throw HostError(std::string("config: ") + name + " must be a finite number >= " + shortest(lo) + ", got " +
                    shortest(v));
}

// train.rampup_batch_size against the other batch fields, on its own (the ranks' layout is
// checked where it is known, by BatchPlan).
void validate_rampup(const config::TrainingConfig& t) {
  const RampUp r = parse_rampup(t.rampup_batch_size());
  if (t.train_samples() <= 0)
    throw HostError(
        "config: train.rampup_batch_size needs sample-based training (train.train_samples with "
        "train.train_iters=0), as Megatron asserts ('expected no batch-size rampup for iteration-based "
        "training')");
  if (t.global_batch_size() <= 0)
    throw HostError("config: train.rampup_batch_size needs train.global_batch_size (the size it ramps up to)");
  if (r.start >= t.global_batch_size() || (t.global_batch_size() - r.start) % r.increment != 0)
    throw HostError("config: train.rampup_batch_size '" + t.rampup_batch_size() + "': START " +
                    std::to_string(r.start) + " must be below train.global_batch_size " +
                    std::to_string(t.global_batch_size()) + " and their difference a multiple of INCREMENT " +
                    std::to_string(r.increment));
  if (t.gradient_accumulation_steps() > 0)
    throw HostError(
        "config: train.rampup_batch_size and train.gradient_accumulation_steps contradict each other "
        "(the number of micro-batches changes during the ramp-up)");
}

// train.step_batch_size_schedule against the other batch fields (the ranks' layout is checked by
// BatchPlan): Megatron sizes the run and its data in samples under a schedule.
void validate_step_batch_schedule(const config::TrainingConfig& t) {
  parse_step_batch_schedule(t.step_batch_size_schedule(), t.seq_length());
  const std::string field = "config: train.step_batch_size_schedule ";
  if (t.train_samples() <= 0)
    throw HostError(field +
                    "needs sample-based training (train.train_samples with train.train_iters=0): with iterations "
                    "Megatron sizes the data and the learning-rate schedule by micro_batch_size x data-parallel "
                    "size samples an iteration, not by the schedule's batches");
  if (t.global_batch_size() > 0)
    throw HostError(field +
                    "and train.global_batch_size cannot both be set (Megatron refuses both): the schedule gives "
                    "every iteration's global batch; set train.global_batch_size=0");
  if (!t.rampup_batch_size().empty())
    throw HostError(field +
                    "and train.rampup_batch_size cannot both be set (Megatron's schedule replaces the ramp-up)");
  if (t.gradient_accumulation_steps() > 0)
    throw HostError(field +
                    "and train.gradient_accumulation_steps contradict each other (the number of micro-batches "
                    "follows the schedule)");
}

// The run's length, batch, dtype and device; in the order validate_config always checked them
// (the first error a user sees depends on it).
void validate_training(const config::TrainingConfig& t) {
  require_positive(t.micro_batch_size(), "train.micro_batch_size");
  if (t.train_samples() < 0) throw HostError("config: train.train_samples must be >= 0");
  if (t.consumed_samples() < 0) throw HostError("config: train.consumed_samples must be >= 0");
  if (!t.step_batch_size_schedule().empty()) validate_step_batch_schedule(t);
  if (!t.rampup_batch_size().empty()) validate_rampup(t);
  if (t.train_samples() > 0 && t.train_iters() > 0)
    throw HostError("config: train.train_iters and train.train_samples cannot both be set (Megatron refuses it too); "
                    "set train.train_iters=0 with train.train_samples");
  if (t.train_samples() == 0) require_positive(t.train_iters(), "train.train_iters");
  if (!t.dataloader_type().empty() && t.dataloader_type() != "single" && t.dataloader_type() != "cyclic")
    throw HostError("config: train.dataloader_type must be single or cyclic, got '" + t.dataloader_type() + "'");
  if (t.has_data_sharding() && t.dataloader_type() != "cyclic")
    throw HostError(
        "config: train.data_sharding applies to train.dataloader_type=cyclic only (the single sampler "
        "reads the samples in order)");
  require_positive(t.seq_length(), "train.seq_length");
  if (t.global_batch_size() < 0) throw HostError("config: train.global_batch_size must be >= 0");
  if (t.params_dtype() != "fp32" && t.params_dtype() != "bf16" && t.params_dtype() != "fp16")
    throw HostError("config: train.params_dtype must be fp32, bf16 or fp16, got '" + t.params_dtype() + "'");
  if (!valid_device_spec(t.device()))
    throw HostError("config: train.device must be cpu, cuda or cuda:N, got '" + t.device() + "'");
  if (t.threads() < 0) throw HostError("config: train.threads must be >= 0");
  if (t.memory_limit_mb() < 0) throw HostError("config: train.memory_limit_mb must be >= 0 (0 = no budget)");
  if (t.clip_grad() < 0) throw HostError("config: train.clip_grad must be >= 0");
}

// The warm-up's shape; DeepSpeed's schedulers count optimizer steps, so their lengths are in
// iterations, at a fixed global batch.
void validate_warmup_style(const config::LrSchedule& lr, const config::TrainingConfig& t) {
  const std::string& warmup = lr.lr_warmup_style();
  const bool warmup_style = is_deepspeed_warmup_style(lr.lr_decay_style());
  if (!warmup.empty() && warmup != "linear" && warmup != "log")
    throw HostError("config: lr.lr_warmup_style must be linear or log, got '" + warmup + "'");
  if (warmup == "log" && !warmup_style)
    throw HostError(
        "config: lr.lr_warmup_style=log is DeepSpeed's warm-up, for its schedulers (lr.lr_decay_style "
        "WarmupLR, WarmupDecayLR, WarmupCosineLR); it is " +
        lr.lr_decay_style());
  if (!is_deepspeed_style(lr.lr_decay_style())) return;
  const std::string style = "config: lr.lr_decay_style=" + lr.lr_decay_style();
  if (lr.lr_warmup_samples() > 0 || lr.lr_decay_samples() > 0 || !t.rampup_batch_size().empty() ||
      !t.step_batch_size_schedule().empty())
    throw HostError(style +
                    " counts optimizer steps at one global batch: give lr.lr_warmup_iters and lr.lr_decay_iters, "
                    "not lr.*_samples, train.rampup_batch_size or train.step_batch_size_schedule");
  if (!warmup_style) return;  // LRRangeTest and OneCycle have no warm-up (their lengths are lr.cycle_*)
  if (lr.lr_warmup_iters() < 1)
    throw HostError(style + " needs lr.lr_warmup_iters >= 1 (DeepSpeed's warmup_num_steps must be positive)");
  if (lr.lr_warmup_fraction() > 0)
    throw HostError(style +
                    " counts optimizer steps at one global batch: give lr.lr_warmup_iters and lr.lr_decay_iters, "
                    "not lr.lr_warmup_fraction");
  if (lr.lr_decay_style() != "WarmupLR" && lr.lr_decay_iters() < 1)
    throw HostError(style + " needs lr.lr_decay_iters (DeepSpeed's total_num_steps) >= 1");
}

// DeepSpeed's LRRangeTest and OneCycle: their settings only under their style, each in
// DeepSpeed's range (stricter where DeepSpeed would train on nonsense: whole steps, momenta that
// Adam can use).
void validate_cycle_schedule(const config::LrSchedule& lr) {
  const std::string& style = lr.lr_decay_style();
  const bool range =
      lr.has_lr_range_test_step_size() || lr.has_lr_range_test_step_rate() || lr.lr_range_test_staircase();
  if (range && style != "LRRangeTest")
    throw HostError("config: lr.lr_range_test_* do nothing without lr.lr_decay_style=LRRangeTest (it is " + style +
                    "): drop them, or set the style");
  const bool cycle = lr.has_cycle_first_step_size() || lr.has_cycle_second_step_size() ||
                     lr.cycle_first_stair_count() != 0 || lr.has_cycle_second_stair_count() ||
                     lr.decay_step_size() != 0 || lr.decay_lr_rate() != 0 || lr.has_cycle_momentum() ||
                     lr.has_cycle_min_mom() || lr.has_cycle_max_mom() || lr.decay_mom_rate() != 0;
  if (cycle && style != "OneCycle")
    throw HostError(
        "config: lr.cycle_* and lr.decay_step_size/decay_lr_rate/decay_mom_rate do nothing without "
        "lr.lr_decay_style=OneCycle (it is " +
        style + "): drop them, or set the style");
  const auto at_least = [](const char* name, bool has, int64_t value, int64_t floor) {
    if (has && value < floor)
      throw HostError(std::string("config: lr.") + name + " must be >= " + std::to_string(floor) + ", got " +
                      std::to_string(value));
  };
  at_least("lr_range_test_step_size", lr.has_lr_range_test_step_size(), lr.lr_range_test_step_size(), 1);
  at_least("cycle_first_step_size", lr.has_cycle_first_step_size(), lr.cycle_first_step_size(), 1);
  at_least("cycle_second_step_size", lr.has_cycle_second_step_size(), lr.cycle_second_step_size(), 0);
  at_least("cycle_first_stair_count", true, lr.cycle_first_stair_count(), 0);
  at_least("cycle_second_stair_count", lr.has_cycle_second_stair_count(), lr.cycle_second_stair_count(), 0);
  at_least("decay_step_size", true, lr.decay_step_size(), 0);
  for (const auto& [name, value] :
       {std::pair{"lr_range_test_step_rate", lr.lr_range_test_step_rate()},
        std::pair{"decay_lr_rate", lr.decay_lr_rate()}, std::pair{"decay_mom_rate", lr.decay_mom_rate()}})
    if (!std::isfinite(value)) throw HostError(std::string("config: lr.") + name + " must be a finite number");
  for (const auto& [name, has, value] : {std::tuple{"cycle_min_mom", lr.has_cycle_min_mom(), lr.cycle_min_mom()},
                                         std::tuple{"cycle_max_mom", lr.has_cycle_max_mom(), lr.cycle_max_mom()}})
    if (has && !(value >= 0 && value < 1))
      throw HostError(std::string("config: lr.") + name + " is Adam's beta1, in [0, 1); got " + number_text(value));
}

// The learning-rate schedule: decay style, warm-up and decay by iterations or samples, WSD.
void validate_lr_schedule(const config::LrSchedule& lr, const config::TrainingConfig& t) {
  const std::string& style = lr.lr_decay_style();
  if (lr.lr() < 0 || lr.min_lr() < 0) throw HostError("config: lr.lr and lr.min_lr must be >= 0");
  if (style != "constant" && style != "linear" && style != "cosine" && style != "inverse-square-root" &&
      style != "WSD" && !is_deepspeed_style(style))
    throw HostError(
        "config: lr.lr_decay_style must be constant, linear, cosine, inverse-square-root, WSD, or DeepSpeed's "
        "WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest or OneCycle, got '" +
        style + "'");
  validate_warmup_style(lr, t);
  validate_cycle_schedule(lr);
  // Under a step schedule an iteration has no one batch to count lengths in: samples, as
  // Megatron asserts for sample-based training (the batch stays micro-batch x data-parallel size
  // there, which would silently shrink a length given in iterations).
  if (!t.step_batch_size_schedule().empty())
    for (const auto& [value, field, samples] :
         {std::tuple{lr.lr_warmup_iters(), "lr.lr_warmup_iters", "lr.lr_warmup_samples or lr.lr_warmup_fraction"},
          std::tuple{lr.lr_decay_iters(), "lr.lr_decay_iters", "lr.lr_decay_samples (0: train.train_samples)"},
          std::tuple{lr.lr_wsd_decay_iters(), "lr.lr_wsd_decay_iters",
                     "another lr.lr_decay_style (WSD's length in samples, --lr-wsd-decay-samples, is not built)"}})
      if (value > 0)
        throw HostError(std::string("config: ") + field + " " + std::to_string(value) +
                        " counts iterations, which have no one batch under train.step_batch_size_schedule: give " +
                        samples + " (set " + field + "=0)");
  if (lr.lr_warmup_iters() < 0) throw HostError("config: lr.lr_warmup_iters must be >= 0");
  if (lr.lr_decay_iters() < 0) throw HostError("config: lr.lr_decay_iters must be >= 0 (0 = train.train_iters)");
  if (!std::isfinite(lr.lr()) || !std::isfinite(lr.min_lr()) || !std::isfinite(lr.lr_warmup_init()) ||
      !std::isfinite(lr.weight_decay()))
    throw HostError("config: lr.lr, lr.min_lr, lr.lr_warmup_init and lr.weight_decay must be finite numbers");
  if (!(lr.lr_warmup_fraction() >= 0 && lr.lr_warmup_fraction() < 1))
    throw HostError("config: lr.lr_warmup_fraction must be in [0, 1)");
  if (lr.lr_warmup_fraction() > 0 && lr.lr_warmup_iters() > 0)
    throw HostError("config: lr.lr_warmup_fraction and lr.lr_warmup_iters cannot both be set (Megatron refuses it too)");
  if (lr.lr_decay_samples() < 0 || lr.lr_warmup_samples() < 0)
    throw HostError("config: lr.lr_decay_samples and lr.lr_warmup_samples must be >= 0");
  if ((lr.lr_decay_samples() > 0 || lr.lr_warmup_samples() > 0) && t.train_samples() <= 0)
    throw HostError("config: lr.lr_decay_samples and lr.lr_warmup_samples are for sample-based training "
                    "(train.train_samples); with train.train_iters give lr.lr_decay_iters and lr.lr_warmup_iters "
                    "(Megatron asserts it too)");
  if (lr.lr_decay_samples() > 0 && lr.lr_decay_iters() > 0)
    throw HostError("config: lr.lr_decay_samples and lr.lr_decay_iters cannot both be set");
  if (lr.lr_warmup_samples() > 0 && (lr.lr_warmup_iters() > 0 || lr.lr_warmup_fraction() > 0))
    throw HostError("config: lr.lr_warmup_samples cannot be combined with lr.lr_warmup_iters or lr.lr_warmup_fraction");
  // DeepSpeed's schedulers run a falling warm-up too (warmup_min_lr above warmup_max_lr).
  if (lr.lr_warmup_init() < 0 || (lr.lr_warmup_init() > lr.lr() && !is_deepspeed_style(style)))
    throw HostError("config: lr.lr_warmup_init must be in [0, lr.lr]");
  const std::string& wsd = lr.lr_wsd_decay_style();
  if (!wsd.empty() && wsd != "exponential" && wsd != "linear" && wsd != "cosine" && wsd != "minus_sqrt")
    throw HostError("config: lr.lr_wsd_decay_style must be exponential, linear, cosine or minus_sqrt, got '" + wsd + "'");
  if (lr.lr_wsd_decay_iters() < 0) throw HostError("config: lr.lr_wsd_decay_iters must be >= 0");
  if (style == "WSD") {
    const int64_t decay_len = lr.lr_decay_iters() > 0 ? lr.lr_decay_iters() : t.train_iters();
    // decay_len 0: train_samples decides it (the Trainer checks once the global batch is known).
    if (lr.lr_wsd_decay_iters() <= 0 || (decay_len > 0 && lr.lr_wsd_decay_iters() > decay_len))
      throw HostError("config: lr.lr_decay_style=WSD needs lr.lr_wsd_decay_iters in [1, " + std::to_string(decay_len) +
                      "] (the decay length), got " + std::to_string(lr.lr_wsd_decay_iters()));
  } else if (!wsd.empty() || lr.lr_wsd_decay_iters() != 0) {  // Megatron reads them only under WSD
    throw HostError(std::string("config: ") + (wsd.empty() ? "lr.lr_wsd_decay_iters" : "lr.lr_wsd_decay_style") +
                    " does nothing without lr.lr_decay_style=WSD (it is " + style +
                    "): drop it, or set lr.lr_decay_style=WSD");
  }
}

// The schedule's bounds: min_lr below lr, the warm-up shorter than the decay.
void validate_lr_bounds(const config::LrSchedule& lr, const config::TrainingConfig& t) {
  // DeepSpeed's schedulers take what DeepSpeed takes: a floor above the peak, a warm-up as long as
  // the decay or longer (DeepSpeed warns; its formulas then hold the floor).
  if (is_deepspeed_style(lr.lr_decay_style())) return;
  if (lr.min_lr() > lr.lr())
    throw HostError("config: lr.min_lr (" + std::to_string(lr.min_lr()) + ") is larger than lr.lr (" +
                    std::to_string(lr.lr()) + ")");
  const int64_t decay = lr.lr_decay_iters() > 0 ? lr.lr_decay_iters() : t.train_iters();
  if (decay > 0 && lr.lr_warmup_iters() >= decay && lr.lr_decay_style() != "constant")
    throw HostError("config: lr.lr_warmup_iters (" + std::to_string(lr.lr_warmup_iters()) +
                    ") must be smaller than the decay length (" + std::to_string(decay) +
                    " = lr.lr_decay_iters, or train.train_iters when that is 0)");
}

// Megatron-DeepSpeed's token counts: the run's end (train.train_tokens) and the schedule's
// warm-up and decay lengths (lr.lr_warmup_tokens, lr.lr_decay_tokens).
void validate_token_counts(const config::LrSchedule& lr, const config::TrainingConfig& t) {
  if (t.train_tokens() < 0) throw HostError("config: train.train_tokens must be >= 0 (0 = no token limit)");
  const bool warmup = lr.has_lr_warmup_tokens(), decay = lr.has_lr_decay_tokens();
  if (!warmup && !decay) return;
  if (warmup && lr.lr_warmup_tokens() < 0)
    throw HostError("config: lr.lr_warmup_tokens must be >= 0, got " + std::to_string(lr.lr_warmup_tokens()));
  if (decay && lr.lr_decay_tokens() <= 0)
    throw HostError("config: lr.lr_decay_tokens must be positive, got " + std::to_string(lr.lr_decay_tokens()));
  const std::string& style = lr.lr_decay_style();
  if (style == "WSD" || is_deepspeed_style(style))
    throw HostError(
        "config: lr.lr_warmup_tokens and lr.lr_decay_tokens are Megatron-DeepSpeed's, for the constant, "
        "linear, cosine and inverse-square-root styles; lr.lr_decay_style is " +
        style);
  if (warmup && (lr.lr_warmup_iters() > 0 || lr.lr_warmup_fraction() > 0 || lr.lr_warmup_samples() > 0))
    throw HostError(
        "config: lr.lr_warmup_tokens replaces the step warm-up: drop lr.lr_warmup_iters, lr.lr_warmup_fraction and "
        "lr.lr_warmup_samples (Megatron-DeepSpeed would warm up by tokens and still start a step-counted decay "
        "after the step warm-up)");
  if (warmup && decay && lr.lr_warmup_tokens() >= lr.lr_decay_tokens() && style != "constant")
    throw HostError("config: lr.lr_warmup_tokens (" + std::to_string(lr.lr_warmup_tokens()) +
                    ") must be smaller than lr.lr_decay_tokens (" + std::to_string(lr.lr_decay_tokens()) + ")");
}

// Loss scaling, bench mode, exit conditions, timing and a few device limits.
void validate_scaling_and_exits(const config::RunConfig& cfg) {
  const auto& t = cfg.train();
  require_finite_at_least(t.loss_scale(), 0, "train.loss_scale");
  require_finite_at_least(t.initial_loss_scale(), 0, "train.initial_loss_scale");
  // A scale beyond 2^64 overflows any loss's gradients in fp32 and bf16: every step would be skipped.
  for (const auto& [v, name] : {std::pair<double, const char*>{t.loss_scale(), "train.loss_scale"},
                                {t.initial_loss_scale(), "train.initial_loss_scale"},
                                {t.min_loss_scale(), "train.min_loss_scale"}})
    if (v > 18446744073709551616.0) {
      char got[32];
      std::snprintf(got, sizeof got, "%g", v);
      throw HostError(std::string("config: ") + name + " must be at most 2^64 (Megatron's default is 2^32), got " + got);
    }
  require_finite_at_least(t.min_loss_scale(), 0, "train.min_loss_scale");
  if (t.loss_scale_window() < 0 || t.hysteresis() < 0)
    throw HostError("config: train.loss_scale_window and train.hysteresis must be >= 0 (0 = Megatron's default)");
  if (t.min_loss_scale() > 0 && t.initial_loss_scale() > 0 && t.min_loss_scale() > t.initial_loss_scale())
    throw HostError("config: train.min_loss_scale is larger than train.initial_loss_scale");
  if (t.bench_steps() < 0 || t.perf_warmup_steps() < 0)
    throw HostError("config: train.bench_steps and train.perf_warmup_steps must be >= 0");
  if (t.skipped_steps_limit() < -1)
    throw HostError("config: train.skipped_steps_limit must be -1 (never stop), 0 (10) or positive, got " +
                    std::to_string(t.skipped_steps_limit()));
  if (t.exit_interval() < 0) throw HostError("config: train.exit_interval must be >= 0 (0 = off)");
  require_finite_at_least(t.exit_duration_in_mins(), 0, "train.exit_duration_in_mins");
  require_finite_at_least(cfg.logging().peak_tflops(), 0, "logging.peak_tflops");
  if (cfg.logging().timing_log_level() < 0 || cfg.logging().timing_log_level() > 2)
    throw HostError("config: logging.timing_log_level must be 0, 1 or 2, got " +
                    std::to_string(cfg.logging().timing_log_level()));
  if (t.threads() > 4096) throw HostError("config: train.threads must be at most 4096");
  if (t.params_dtype() == "fp16" && t.device() == "cpu")
    throw HostError(
        "config: train.params_dtype=fp16 needs train.device=cuda (LibTorch has no fp16 matmul on CPU); "
        "use bf16 on CPU");
}

// An iteration range option (logging.trace_iterations, logging.profile_steps): valid, and
// starting inside the run when `used` (its output is on), else `empty` would happen.
void validate_iterations(const char* field, const std::string& spec, bool used, const char* empty,
                         const config::RunConfig& cfg) {
  if (spec.empty()) return;
  int64_t first = 0, last = 0;
  try {
    trace::parse_iterations(field, spec, &first, &last);
  } catch (const std::exception& e) {
    throw HostError(std::string("config: ") + e.what());
  }
  // train_iters 0: train_samples decides the length (known once the global batch is).
  const int64_t iters = cfg.train().train_iters();
  if (used && iters > 0 && first > iters)
    throw HostError(std::string("config: ") + field + " '" + spec + "' starts after the last iteration (train.train_iters " +
                    std::to_string(iters) + "): " + empty);
}

// Parallel sizes, the trace, the backend and the simulated link.
// Context parallelism (distributed.context_parallel_size > 1): each sequence in 2 x cp equal
// chunks, each rank's share split again by sequence parallelism. (Expert parallelism carves its
// groups from the same data- and context-parallel ranks: launch/distributed.cpp.)
void validate_context_parallel(const config::RunConfig& cfg) {
  const auto& d = cfg.distributed();
  const int64_t cp = d.context_parallel_size(), seq = cfg.train().seq_length();
  const std::string name = "config: distributed.context_parallel_size " + std::to_string(cp);
  if (seq > 0 && seq % (2 * cp) != 0)
    throw HostError(name + " splits each sequence into " + std::to_string(2 * cp) + " equal chunks (Megatron's " +
                    "load-balanced split): train.seq_length " + std::to_string(seq) + " must be a multiple of " +
                    std::to_string(2 * cp));
  const int64_t tp = d.tensor_model_parallel_size();
  if (seq > 0 && d.sequence_parallel() && tp > 1 && (seq / cp) % tp != 0)
    throw HostError(name + " leaves each rank " + std::to_string(seq / cp) +
                    " positions of a sequence, which distributed.sequence_parallel cannot split over the "
                    "tensor-parallel size " +
                    std::to_string(tp));
}

void validate_distributed(const config::RunConfig& cfg) {
  const auto& t = cfg.train();
  // Sections whose features arrive with later releases: refuse rather than silently ignore.
  const auto& d = cfg.distributed();
  if (d.tensor_model_parallel_size() < 1 || d.pipeline_model_parallel_size() < 1)
    throw HostError("config: distributed.*_model_parallel_size must be at least 1");
  if (d.timeout_seconds() < 0) throw HostError("config: distributed.timeout_seconds must not be negative");
  if (d.virtual_pipeline_model_parallel_size() < 0 || d.virtual_pipeline_model_parallel_size() > 4096)
    throw HostError(
        "config: distributed.virtual_pipeline_model_parallel_size must be between 1 and 4096 (0 or 1: no "
        "interleaving), got " +
        std::to_string(d.virtual_pipeline_model_parallel_size()));
  if (d.virtual_pipeline_model_parallel_size() > 1 && d.pipeline_model_parallel_size() < 2)
    throw HostError("config: distributed.virtual_pipeline_model_parallel_size " +
                    std::to_string(d.virtual_pipeline_model_parallel_size()) +
                    " (the interleaved schedule) needs distributed.pipeline_model_parallel_size >= 2");
  for (const auto& [field, layers] :
       {std::pair<const char*, int32_t>{"decoder_first_pipeline_num_layers", d.decoder_first_pipeline_num_layers()},
        {"decoder_last_pipeline_num_layers", d.decoder_last_pipeline_num_layers()}})
    if (layers < 0)
      throw HostError(std::string("config: distributed.") + field + " must be at least 1 (0: unset), got " +
                      std::to_string(layers));
  if (d.decoder_first_pipeline_num_layers() > 0 && d.decoder_last_pipeline_num_layers() > 0 &&
      d.pipeline_model_parallel_size() < 2)
    throw HostError(
        "config: distributed.decoder_first_pipeline_num_layers and decoder_last_pipeline_num_layers both name the one "
        "pipeline rank of pipeline_model_parallel_size 1");
  if ((d.decoder_first_pipeline_num_layers() > 0 || d.decoder_last_pipeline_num_layers() > 0) &&
      (d.account_for_embedding_in_pipeline_split() || d.account_for_loss_in_pipeline_split()))
    throw HostError(
        "config: distributed.decoder_first/last_pipeline_num_layers cannot go with "
        "account_for_embedding/loss_in_pipeline_split (Megatron-LM refuses them together too)");
  if (d.expert_model_parallel_size() < 0)
    throw HostError(
        "config: distributed.expert_model_parallel_size must be at least 1 (0 or 1: no expert parallelism), got " +
        std::to_string(d.expert_model_parallel_size()));
  if (d.context_parallel_size() < 0)
    throw HostError(
        "config: distributed.context_parallel_size must be at least 1 (0 or 1: no context parallelism), got " +
        std::to_string(d.context_parallel_size()));
  if (!d.cp_comm_type().empty() && d.cp_comm_type() != "a2a" && d.cp_comm_type() != "all_gather")
    throw HostError("config: distributed.cp_comm_type must be a2a or all_gather (Megatron's --cp-comm-type), got '" +
                    d.cp_comm_type() + "'");
  if (d.context_parallel_size() > 1) validate_context_parallel(cfg);
  if (d.sequence_parallel() && d.tensor_model_parallel_size() > 1 && t.seq_length() > 0 &&
      t.seq_length() % d.tensor_model_parallel_size() != 0)
    throw HostError("config: distributed.sequence_parallel splits train.seq_length " + std::to_string(t.seq_length()) +
                    " over the tensor-parallel size " + std::to_string(d.tensor_model_parallel_size()) +
                    ", which does not divide it");
  if (!cfg.logging().trace_iterations().empty() && cfg.logging().trace_file().empty())
    throw HostError(
        "config: logging.trace_iterations does nothing without logging.trace_file: drop it, or set "
        "logging.trace_file=trace.json");
  validate_iterations("logging.trace_iterations", cfg.logging().trace_iterations(), !cfg.logging().trace_file().empty(),
                      "the trace would stay empty", cfg);
  validate_iterations("logging.profile_steps", cfg.logging().profile_steps(), true, "nothing would be profiled", cfg);
  if (!d.backend().empty() && d.backend() != "gloo") {
    if (d.backend() != "nccl")
      throw HostError("config: distributed.backend must be gloo or nccl, got '" + d.backend() + "'");
    // NCCL carries CUDA tensors: it comes with train.device=cuda (and a build that can train there).
    std::string why;
    if (!cuda_training_available(&why)) throw HostError("config: distributed.backend=nccl: " + why);
    if (t.device() == "cpu")
      throw HostError("config: distributed.backend=nccl needs train.device=cuda (NCCL moves CUDA tensors; "
                      "CPU runs use gloo)");
  }
  try {
    parse_simulated_link(d.simulated_link());
  } catch (const std::exception& e) {
    throw HostError(std::string("config: ") + e.what());
  }
}

// train.curriculum_*: the settings and the lengths they give over train_iters (the stages the run
// works out again in BatchPlan, over the iterations train.train_samples gives), and a bench run,
// whose summary is of one steady step.
void validate_curriculum(const config::RunConfig& cfg) {
  const config::TrainingConfig& t = cfg.train();
  if (!SequenceCurriculum(t, t.train_iters()).active()) return;
  if (t.bench_steps() > 0 || !cfg.logging().bench_out().empty())
    throw HostError(std::string("config: ") + (t.bench_steps() > 0 ? "train.bench_steps" : "logging.bench_out") +
                    " measures iterations of one size; train.curriculum_schedule changes their sequence length: "
                    "drop one of them");
}

// A bench run's summary is of one steady step: a batch that changes (a ramp-up, a step schedule)
// has none.
void validate_bench_batch(const config::RunConfig& cfg) {
  const config::TrainingConfig& t = cfg.train();
  if (t.rampup_batch_size().empty() && t.step_batch_size_schedule().empty()) return;
  if (t.bench_steps() > 0 || !cfg.logging().bench_out().empty())
    throw HostError(std::string("config: ") + (t.bench_steps() > 0 ? "train.bench_steps" : "logging.bench_out") +
                    " measures iterations of one size; " +
                    (t.rampup_batch_size().empty() ? "train.step_batch_size_schedule" : "train.rampup_batch_size") +
                    " changes their global batch: drop one of them");
}

// Checkpoint saving and loading, then the plugin slots.
void validate_checkpoint_and_slots(const config::RunConfig& cfg) {
  // Tensor and pipeline parallelism run over the Gloo process groups (core/runtime/src/distributed.cpp);
  // the world size must be a multiple of their product, which init_distributed checks once the
  // world is known.
  if (cfg.checkpoint().override_opt_param_scheduler() && cfg.checkpoint().use_checkpoint_opt_param_scheduler())
    throw HostError(
        "config: checkpoint.override_opt_param_scheduler and checkpoint.use_checkpoint_opt_param_scheduler "
        "contradict each other; set one");
  if (cfg.checkpoint().save_interval() < 0) throw HostError("config: checkpoint.save_interval must not be negative");
  if (cfg.checkpoint().keep_last() < 0)
    throw HostError("config: checkpoint.keep_last must be >= 0 (0 keeps every checkpoint)");
  if (cfg.checkpoint().keep_last() > 0 && cfg.checkpoint().save().empty())
    throw HostError("config: checkpoint.keep_last needs checkpoint.save (the directory to rotate)");
  if (cfg.checkpoint().fallback() && cfg.checkpoint().load().empty())
    throw HostError("config: checkpoint.fallback needs checkpoint.load (the directory to load from)");
  // checkpoint.save_interval without checkpoint.save: accepted with no effect, as Megatron accepts
  // --save-interval without --save (the Trainer says so at start).

  for (const auto* slot : {&cfg.model(), &cfg.dataset(), &cfg.step(), &cfg.optimizer(), &cfg.strategy()})
    if (slot->name().empty())
      throw HostError("config: every plugin slot needs a name (model, dataset, step, optimizer, strategy)");
}

}  // namespace

// The checks run in a fixed order: the first failing one is the error a user sees.
void validate_config(const config::RunConfig& cfg) {
  require_finite_numbers(cfg, "");
  const auto& t = cfg.train();
  validate_training(t);
  const auto& lr = cfg.lr();
  validate_lr_schedule(lr, t);
  validate_weight_decay(lr);
  if (cfg.eval().eval_interval() < 0 || cfg.eval().eval_iters() < 0)
    throw HostError("config: eval.eval_interval and eval.eval_iters must be >= 0");
  if (cfg.logging().log_interval() <= 0) throw HostError("config: logging.log_interval must be positive");
  if (cfg.logging().tensorboard_log_interval() < 0)
    throw HostError("config: logging.tensorboard_log_interval must be >= 0 (0 = every iteration)");
  validate_lr_bounds(lr, t);
  validate_token_counts(lr, t);
  if (t.seed() == 0) throw HostError("config: train.seed must be positive (Megatron refuses seed 0)");
  validate_scaling_and_exits(cfg);
  validate_distributed(cfg);
  validate_curriculum(cfg);
  validate_bench_batch(cfg);
  validate_checkpoint_and_slots(cfg);
}

namespace {

// `message` in text format, as TextFormat prints it, plus every scalar it holds at zero (which
// proto3 does not print) where `defaults` (the same message of the built-in defaults) is not zero:
// the text, read back over the defaults (--config), must give this message, not the defaults.
std::string text_over_defaults(const Message& message, const Message* defaults, int indent) {
  const Reflection* r = message.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(message, &fields);
  const std::vector<const FieldDescriptor*> present = fields;  // (fields is extended and sorted below)
  for (int i = 0; defaults && i < message.GetDescriptor()->field_count(); ++i) {
    const FieldDescriptor* f = message.GetDescriptor()->field(i);
    if (!f->is_repeated() && f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE && !r->HasField(message, f) &&
        defaults->GetReflection()->HasField(*defaults, f))
      fields.push_back(f);
  }
  std::sort(fields.begin(), fields.end(), [](auto* a, auto* b) { return a->number() < b->number(); });
  const std::string pad(indent, ' ');
  std::string out;
  for (const FieldDescriptor* f : fields) {
    if (f->is_repeated()) {  // a list or map: TextFormat's own printing (maps sorted by key)
      std::unique_ptr<Message> alone(message.New());
      alone->CopyFrom(message);
      for (const FieldDescriptor* other : present)
        if (other != f) alone->GetReflection()->ClearField(alone.get(), other);
      TextFormat::Printer printer;
      printer.SetInitialIndentLevel(indent / 2);
      std::string text;
      printer.PrintToString(*alone, &text);
      out += text;
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      const Message* sub_defaults = defaults && defaults->GetReflection()->HasField(*defaults, f)
                                        ? &defaults->GetReflection()->GetMessage(*defaults, f)
                                        : nullptr;
      out += pad + f->name() + " {\n" + text_over_defaults(r->GetMessage(message, f), sub_defaults, indent + 2) + pad +
             "}\n";
    } else {
      std::string value;
      TextFormat::PrintFieldValueToString(message, f, -1, &value);
      out += pad + f->name() + ": " + value + "\n";
    }
  }
  return out;
}

}  // namespace

std::string to_text(const config::RunConfig& cfg) {
  static const config::RunConfig defaults = default_config();
  return text_over_defaults(cfg, &defaults, 0);
}

bool is_deepspeed_warmup_style(const std::string& style) {
  return style == "WarmupLR" || style == "WarmupDecayLR" || style == "WarmupCosineLR";
}
bool is_deepspeed_cycle_style(const std::string& style) { return style == "LRRangeTest" || style == "OneCycle"; }
bool is_deepspeed_style(const std::string& style) {
  return is_deepspeed_warmup_style(style) || is_deepspeed_cycle_style(style);
}

std::string warmup_style_of(const config::LrSchedule& lr) {
  if (!lr.lr_warmup_style().empty()) return lr.lr_warmup_style();
  return is_deepspeed_warmup_style(lr.lr_decay_style()) ? "log" : "linear";
}

std::string number_text(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9.2e18) return std::to_string(static_cast<long long>(v));
  char buf[40];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

}  // namespace dtk::core
