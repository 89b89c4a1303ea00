// Every `--set path=value` example a user can read (README.md, docs/*.md, `dtk --help`) is
// accepted by `dtk config`: documentation that names a config field which does not exist fails
// here instead of in a new user's first command.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../common/run_dtk.hpp"

namespace {

#define DTK_SECTIONS "(?:train|lr|eval|logging|checkpoint|distributed|model|dataset|step|optimizer|strategy)"

// "section.field=value" where section is a config section or a plugin slot. A comma followed by
// more value continues it ("25us,50GBps"); one followed by a space ends it (prose). A
// single-quoted example ('lr.param_rules=match: "bias$" wd_mult: 0') is taken whole.
// The section listing bad inputs ("## What DTK refuses ...") shows examples that must fail: left out.
std::set<std::string> set_examples(std::string text) {
  const size_t bad = text.find("\n## What DTK refuses");
  if (bad != std::string::npos) {
    const size_t next = text.find("\n## ", bad + 1);
    text.erase(bad, next == std::string::npos ? std::string::npos : next - bad);
  }
  static const std::regex quoted("'(" DTK_SECTIONS R"(\.[a-z_][a-z0-9_.]*=[^'\n]*)')");
  static const std::regex re(R"(\b()" DTK_SECTIONS R"(\.[a-z_][a-z0-9_.]*)=([^\s`'",)|\]]*(?:,[^\s`'",)|\]]+)*))");
  std::set<std::string> out;
  for (std::sregex_iterator it(text.begin(), text.end(), quoted), end; it != end; ++it)
    out.insert("'" + std::string((*it)[1]) + "'");
  text = std::regex_replace(text, quoted, "");
  for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) {
    const std::string value = (*it)[2];
    if (value.empty() || value == "..." || value.find('<') != std::string::npos) continue;  // placeholders
    out.insert(std::string((*it)[1]) + "=" + value);
  }
  return out;
}

std::string read(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// An example's key, "strategy.stage" in "strategy.stage=3": its slot (or config section)
// "strategy" and its option (or field) "stage".
struct Key {
  std::string full, slot, option;
  explicit Key(const std::string& example) {
    const std::string bare = example[0] == '\'' ? example.substr(1) : example;
    full = bare.substr(0, bare.find('='));
    slot = full.substr(0, full.find('.'));
    option = full.substr(full.find('.') + 1);
  }
};

// An example as one shell word: the extraction keeps quotes out of an unquoted value, and a
// quoted example ('lr.param_rules=...') already is one.
std::string word(const std::string& example) { return example[0] == '\'' ? example : "'" + example + "'"; }

// A name that does not exist or a value of the wrong type is a documentation bug; a value the
// full validation refuses alone (save_interval without save, fp16 on a CPU) or that acts only
// with another setting (strategy.zero_init=false without stage 3) is an example that needs its
// context. The SDK template's option is checked by tools/test.sh.
bool accepted(const dtk_test::Result& r) {
  const bool wrong_name =
      r.out.find("no config field") != std::string::npos || r.out.find("has no option") != std::string::npos ||
      r.out.find("is not a valid") != std::string::npos || r.out.find(" expects ") != std::string::npos;
  const bool needs_context = r.out.find("dtk: error: config: ") != std::string::npos ||
                             r.out.find(" does nothing without ") != std::string::npos;
  return r.code == 0 || (!wrong_name && needs_context);
}

using Batch = std::vector<std::pair<std::string, std::string>>;  // (example, where it appears)

// dtk's plugins by slot, and each plugin's options (`dtk plugins list`, `plugins describe`). A
// plugin option may belong to a plugin other than the default one of its slot (the zero
// strategy's `strategy.stage`): an example passes when some plugin of the slot accepts it.
struct Plugins {
  std::map<std::string, std::vector<std::string>> of_slot;
  std::map<std::string, std::set<std::string>> options;

  // The flag that picks the plugin an example belongs with: none for a config section's field;
  // the first plugin of the slot that lists the option, or the slot's first where none does (it
  // then fails alone, with its message).
  std::string flags_for(const Key& key) const {
    const auto names = of_slot.find(key.slot);
    if (names == of_slot.end() || names->second.empty()) return "";
    std::string owner = names->second.front();
    for (const std::string& name : names->second)
      if (options.count(name) && options.at(name).count(key.option)) {
        owner = name;
        break;
      }
    return " --" + key.slot + " " + owner;
  }
};

Plugins installed_plugins() {
  Plugins out;
  const dtk_test::Result list = dtk_test::run_dtk("plugins list", 60);
  EXPECT_EQ(list.code, 0) << list.out;
  std::istringstream lines(list.out);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::string name, kind;
    if (!(fields >> name >> kind) || name == "NAME") continue;
    out.of_slot[kind].push_back(name);
    const dtk_test::Result described = dtk_test::run_dtk("plugins describe " + name + " --kind " + kind, 60);
    EXPECT_EQ(described.code, 0) << described.out;
    static const std::regex option_line(R"(^  ([a-z_][a-z0-9_]*) +\S)");
    std::istringstream rows(described.out.substr(described.out.find("\noptions:") + 1));
    std::smatch m;
    for (std::string row; std::getline(rows, row);)
      if (std::regex_search(row, m, option_line)) out.options[name].insert(m[1]);
  }
  return out;
}

// Checks examples in batches of one `dtk config` call each (one process per example took
// minutes), a plugin's options under that plugin (`--strategy zero`). dtk applies every --set to
// the config sections (an unknown name or a wrong type stops it there) before it validates the
// whole and, after that, reads the plugins' options: so a batch of config sections alone passes
// as one example would, when it exits 0 or stops at the validation. A batch of plugin options
// passes only when it exits 0; where it fails, its error names the example it stopped at ("has no
// option 'order'", "config: strategy.stage ..."): that one is checked alone and the rest again;
// where it names none, the batch is halved. So every example either passed in a batch or was
// checked alone, with its own message.
class ExampleChecker {
 public:
  explicit ExampleChecker(const Plugins& plugins) : plugins_(plugins) {}

  void check(const std::string& flags, const Batch& batch) {
    if (batch.empty()) return;
    if (batch.size() == 1) return check_one(batch[0].first, batch[0].second, flags);
    std::string args = "config" + flags;
    for (const auto& [example, where] : batch) args += " --set " + word(example);
    const dtk_test::Result r = dtk_test::run_dtk(args, 60);
    if (r.code == 0 || (flags.empty() && accepted(r))) return;
    for (size_t i = 0; i < batch.size(); ++i) {
      const Key key(batch[i].first);
      if (r.out.find("config: " + key.full) == std::string::npos &&
          r.out.find("option '" + key.option + "'") == std::string::npos)
        continue;
      check_one(batch[i].first, batch[i].second, flags);
      Batch rest = batch;
      rest.erase(rest.begin() + static_cast<std::ptrdiff_t>(i));
      return check(flags, rest);
    }
    const auto half = batch.begin() + static_cast<std::ptrdiff_t>(batch.size() / 2);
    check(flags, Batch(batch.begin(), half));
    check(flags, Batch(half, batch.end()));
  }

 private:
  // One example alone: with the plugin its group chose (`flags`; none: the slot's default), then
  // each plugin of the slot.
  void check_one(const std::string& example, const std::string& where, const std::string& flags) {
    dtk_test::Result r = dtk_test::run_dtk("config" + flags + " --set " + word(example), 60);
    const Key key(example);
    std::string outputs = r.out;
    const auto names = plugins_.of_slot.find(key.slot);
    if (names != plugins_.of_slot.end())
      for (const std::string& name : names->second) {
        if (accepted(r)) break;
        if (flags == " --" + key.slot + " " + name) continue;  // tried first
        r = dtk_test::run_dtk("config --" + key.slot + " " + name + " --set " + word(example), 60);
        outputs += r.out;
      }
    EXPECT_TRUE(accepted(r) || example == "optimizer.scale=0.5") << where << ": `--set " << example << "` is refused:\n"
                                                                 << outputs;
  }

  const Plugins& plugins_;
};

// Batches of up to 16, a plugin's with each key once (a plugin option set twice keeps the last
// value, read after the batch: an earlier wrong one would go unseen; a config field's value is
// checked as it is set). lr.param_rules alone: its regular expressions are checked by the
// validation, which stops at the first other example's failure.
std::vector<Batch> batches_of(const std::string& flags, const Batch& group) {
  std::vector<Batch> batches, alone;
  std::vector<std::set<std::string>> keys;
  for (const auto& example : group) {
    const Key key(example.first);
    if (key.full == "lr.param_rules") {
      alone.push_back(Batch{example});
      continue;
    }
    size_t b = 0;
    while (b < batches.size() && (batches[b].size() == 16 || (!flags.empty() && keys[b].count(key.full)))) ++b;
    if (b == batches.size()) batches.emplace_back(), keys.emplace_back();
    batches[b].push_back(example);
    keys[b].insert(key.full);
  }
  batches.insert(batches.end(), alone.begin(), alone.end());
  return batches;
}

}  // namespace

TEST(DocExamples, EverySetExampleIsAcceptedByDtkConfig) {
  const std::filesystem::path src = DTK_SOURCE_DIR;
  std::vector<std::pair<std::string, std::string>> sources;  // (where, text)
  sources.emplace_back("README.md", read(src / "README.md"));
  for (const auto& e : std::filesystem::directory_iterator(src / "docs"))
    if (e.path().extension() == ".md") sources.emplace_back("docs/" + e.path().filename().string(), read(e.path()));
  const dtk_test::Result help = dtk_test::run_dtk("--help", 60);
  ASSERT_EQ(help.code, 0) << help.out;
  sources.emplace_back("dtk --help", help.out);
  std::map<std::string, std::string> examples;  // example -> where (each example once, where it first appears)
  for (const auto& [where, text] : sources)
    for (const auto& example : set_examples(text)) examples.emplace(example, where);
  // The README and the user guide show several; finding none means the extraction broke.
  EXPECT_GE(examples.size(), 8u);

  const Plugins plugins = installed_plugins();
  if (::testing::Test::HasFailure()) return;  // dtk could not list its plugins: said above
  std::map<std::string, Batch> groups;  // the plugin flag ("" or " --strategy zero") -> its examples
  for (const auto& example : examples) groups[plugins.flags_for(Key(example.first))].push_back(example);
  ExampleChecker checker(plugins);
  for (const auto& [flags, group] : groups)
    for (const Batch& batch : batches_of(flags, group)) checker.check(flags, batch);
}
