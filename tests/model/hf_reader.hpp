// The test's own reading of a Hugging Face folder and a DTK checkpoint, independent of DTK's
// code: a safetensors reader checking the format's rules, config.json values by regex, the
// checkpoint's pickled model dict. Shared by hf_export_test.cpp and hf_llama_test.cpp.
#pragma once

#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <utility>
#include <vector>

namespace dtk_test_hf {

inline std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// An independent safetensors reader: name -> tensor, checking the format's rules on the way.
inline std::map<std::string, at::Tensor> read_safetensors(const std::string& path) {
  const std::string data = read(path);
  EXPECT_GE(data.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(data[i]);
  const std::string header = data.substr(8, n);
  const size_t base = 8 + n;
  std::map<std::string, at::Tensor> out;
  std::vector<std::pair<int64_t, int64_t>> spans;
  static const std::regex entry(R"re("([^"]+)"\s*:\s*\{([^{}]*)\})re");
  for (std::sregex_iterator it(header.begin(), header.end(), entry), end; it != end; ++it) {
    const std::string name = (*it)[1], body = (*it)[2];
    if (name == "__metadata__") continue;
    std::smatch m;
    EXPECT_TRUE(std::regex_search(body, m, std::regex(R"re("dtype"\s*:\s*"(\w+)")re"))) << body;
    const std::string dtype = m[1];
    EXPECT_TRUE(std::regex_search(body, m, std::regex(R"re("shape"\s*:\s*\[([\d,\s]*)\])re"))) << body;
    std::vector<int64_t> shape;
    const std::string dims = m[1];
    static const std::regex digits(R"(\d+)");
    for (std::sregex_iterator d(dims.begin(), dims.end(), digits), e; d != e; ++d)
      shape.push_back(std::stoll((*d)[0]));
    EXPECT_TRUE(std::regex_search(body, m, std::regex(R"re("data_offsets"\s*:\s*\[\s*(\d+)\s*,\s*(\d+)\s*\])re")));
    const int64_t begin = std::stoll(m[1]), stop = std::stoll(m[2]);
    spans.emplace_back(begin, stop);
    EXPECT_EQ(dtype, "F32") << name;
    at::Tensor t = at::empty(shape, at::kFloat);
    EXPECT_EQ(static_cast<int64_t>(t.numel() * 4), stop - begin) << name;
    std::memcpy(t.data_ptr(), data.data() + base + begin, static_cast<size_t>(stop - begin));
    out[name] = t;
  }
  // The data section has no holes and nothing after the last tensor.
  std::sort(spans.begin(), spans.end());
  int64_t at_byte = 0;
  for (const auto& [b, e] : spans) {
    EXPECT_EQ(b, at_byte);
    at_byte = e;
  }
  EXPECT_EQ(static_cast<size_t>(at_byte), data.size() - base);
  return out;
}

inline std::string json_value(const std::string& json, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(json, m, std::regex("\"" + key + R"re("\s*:\s*("[^"]*"|[^,\n}]+))re"))) return "";
  std::string v = m[1];
  if (!v.empty() && v.front() == '"') v = v.substr(1, v.size() - 2);
  return v;
}

inline std::map<std::string, at::Tensor> checkpoint_model(const std::string& file) {
  const std::string data = read(file);
  const c10::IValue root = torch::jit::pickle_load(std::vector<char>(data.begin(), data.end()));
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : root.toGenericDict().at("model").toGenericDict())
    out[kv.key().toStringRef()] = kv.value().toTensor();
  return out;
}

}  // namespace dtk_test_hf
