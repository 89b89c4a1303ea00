#include "dtk/core/launch/run_agreement.hpp"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <map>

namespace dtk::core {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

namespace {

void flatten(const Message& msg, const std::string& prefix, std::vector<std::string>* out) {
  const Descriptor* d = msg.GetDescriptor();
  const Reflection* r = msg.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const std::string path = prefix + f->name();
    if (f->is_map()) {
      // Entries by key, sorted (reflection gives them in no particular order).
      std::map<std::string, std::string> entries;
      for (int k = 0; k < r->FieldSize(msg, f); ++k) {
        const Message& e = r->GetRepeatedMessage(msg, f, k);
        const Reflection* er = e.GetReflection();
        const Descriptor* ed = e.GetDescriptor();
        entries[er->GetString(e, ed->FindFieldByName("key"))] = er->GetString(e, ed->FindFieldByName("value"));
      }
      for (const auto& [k, v] : entries) out->push_back(path + "." + k + "=" + v);
    } else if (f->is_repeated()) {
      for (int k = 0; k < r->FieldSize(msg, f); ++k) {
        if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
          flatten(r->GetRepeatedMessage(msg, f, k), path + "[" + std::to_string(k) + "].", out);
        } else {
          std::string v;
          google::protobuf::TextFormat::PrintFieldValueToString(msg, f, k, &v);
          out->push_back(path + "[" + std::to_string(k) + "]=" + v);
        }
      }
    } else if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
      if (r->HasField(msg, f)) flatten(r->GetMessage(msg, f), path + ".", out);
    } else if (path != "train.threads") {
      std::string v;
      google::protobuf::TextFormat::PrintFieldValueToString(msg, f, -1, &v);
      out->push_back(path + "=" + v);
    }
  }
}

std::string value_of(const std::vector<std::string>& lines, const std::string& path) {
  for (const auto& l : lines)
    if (l.compare(0, path.size() + 1, path + "=") == 0) return "'" + l.substr(path.size() + 1) + "'";
  return "(not set)";
}

}  // namespace

std::vector<std::string> describe_run(const config::RunConfig& cfg, const std::vector<std::string>& plugins) {
  std::vector<std::string> out;
  flatten(cfg, "", &out);
  out.insert(out.end(), plugins.begin(), plugins.end());
  return out;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  for (size_t nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1) out.push_back(text.substr(at, nl - at));
  return out;
}

std::string first_difference(const std::vector<std::string>& mine, const std::vector<std::string>& rank0) {
  std::string first;
  for (const auto& l : mine)
    if (std::find(rank0.begin(), rank0.end(), l) == rank0.end()) {
      first = l;
      break;
    }
  if (first.empty())
    for (const auto& l : rank0)
      if (std::find(mine.begin(), mine.end(), l) == mine.end()) {
        first = l;
        break;
      }
  if (first.empty()) return "";
  const std::string path = first.substr(0, first.find('='));
  return path + " is " + value_of(mine, path) + " here and " + value_of(rank0, path) + " on rank 0";
}

}  // namespace dtk::core
