// A plugin's options: declarations checked at load, user values resolved, and the settings an
// option acts with (ABI 2.7's acts_with), refused when idle and dropped from old recordings.
#include "dtk/host/options.hpp"

#include <dtk/comma_list.hpp>

#include "dtk/host/plugin_host.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace dtk::host {

namespace {

bool check_value(const dtk_option_spec& spec, const std::string& v, std::string* why) {
  switch (spec.type) {
    case DTK_OPT_BOOL:
      if (v == "true" || v == "false" || v == "1" || v == "0" || v == "True" || v == "False") return true;
      *why = "expects a boolean (true/false)";
      return false;
    case DTK_OPT_INT: {
      char* end = nullptr;
      errno = 0;
      (void)std::strtoll(v.c_str(), &end, 10);
      if (!v.empty() && *end == '\0' && errno != ERANGE) return true;
      *why = "expects an integer";
      return false;
    }
    case DTK_OPT_FLOAT: {
      char* end = nullptr;
      errno = 0;
      const double x = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0') {
        *why = "expects a number";
        return false;
      }
      // A NaN or an infinity is never a valid rate, probability, scale or epsilon.
      if (!std::isfinite(x) || errno == ERANGE) {
        *why = "expects a finite number";
        return false;
      }
      return true;
    }
    case DTK_OPT_STRING:
      return true;
    case DTK_OPT_ENUM: {
      std::stringstream ss(spec.choices ? spec.choices : "");
      std::string c;
      while (std::getline(ss, c, '|'))
        if (c == v) return true;
      *why = std::string("expects one of ") + (spec.choices ? spec.choices : "(none)");
      return false;
    }
    default:
      *why = "has an unknown option type";
      return false;
  }
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string piece;
  while (std::getline(ss, piece, sep)) out.push_back(piece);
  if (!text.empty() && text.back() == sep) out.emplace_back();  // getline drops a trailing empty piece
  return out;
}

// One setting of an acts_with: the option acts while `setting` holds one of `values`.
struct Alternative {
  std::string setting;
  std::vector<std::string> values;
};

// "a=x|y,b=z" as {{a, {x, y}}, {b, {z}}}; empty, with *why set, when malformed.
std::vector<Alternative> parse_acts_with(const std::string& text, std::string* why) {
  std::vector<Alternative> out;
  for (const std::string& piece : split(text, ',')) {
    const size_t eq = piece.find('=');
    const std::vector<std::string> values =
        eq == std::string::npos ? std::vector<std::string>{} : split(piece.substr(eq + 1), '|');
    const bool empty_value = std::find(values.begin(), values.end(), "") != values.end();
    if (eq == std::string::npos || eq == 0 || values.empty() || empty_value) {
      *why = "acts_with '" + text + "' is not setting=value[|value...][,setting=value...]";
      return {};
    }
    out.push_back({piece.substr(0, eq), values});
  }
  return out;
}

const char* acts_with_of(const dtk_option_spec& spec) {
  const char* text = DTK_HAS_FIELD(dtk_option_spec, &spec, acts_with) ? spec.acts_with : nullptr;
  return text && *text ? text : nullptr;
}

const dtk_option_spec* find_spec(const std::vector<const dtk_option_spec*>& specs, const std::string& name) {
  for (const auto* s : specs)
    if (name == s->name) return s;
  return nullptr;
}

bool is_default(const dtk_option_spec& spec, const std::string& value) {
  return spec.default_value && same_option_value(spec.type, value, spec.default_value);
}

// Whether `spec` acts under `values` (every declared option's value). The declarations were
// checked at load: every setting named is declared and in `values`.
bool acts(const dtk_option_spec& spec, const std::vector<const dtk_option_spec*>& specs,
          const std::map<std::string, std::string>& values) {
  const char* text = acts_with_of(spec);
  if (!text) return true;
  std::string why;
  for (const Alternative& a : parse_acts_with(text, &why)) {
    const dtk_option_spec* setting = find_spec(specs, a.setting);
    auto v = values.find(a.setting);
    if (!setting || v == values.end()) continue;
    for (const std::string& want : a.values)
      if (same_option_value(setting->type, v->second, want)) return true;
  }
  return false;
}

// An acts_with's settings and values, checked against the declarations. "" or the problem.
std::string check_acts_with(const dtk_option_spec& spec, const std::vector<const dtk_option_spec*>& specs) {
  const char* text = acts_with_of(spec);
  if (!text) return "";
  const std::string name = spec.name;
  if (!spec.default_value) return "required option '" + name + "' cannot act only with other settings";
  std::string why;
  const std::vector<Alternative> alternatives = parse_acts_with(text, &why);
  if (alternatives.empty()) return "option '" + name + "': " + why;
  for (const Alternative& a : alternatives) {
    const dtk_option_spec* setting = find_spec(specs, a.setting);
    if (!setting || a.setting == name)
      return "option '" + name + "' acts with '" + a.setting + "', which is not another of its options";
    for (const std::string& v : a.values)
      if (!check_value(*setting, v, &why))
        return "option '" + name + "' acts with " + a.setting + "=" + v + ", but '" + a.setting + "' " + why;
  }
  return "";
}

}  // namespace

bool valid_name(const char* name) {
  if (!name || !*name) return false;
  for (const char* p = name; *p; ++p)
    if (!(std::islower(static_cast<unsigned char>(*p)) || std::isdigit(static_cast<unsigned char>(*p)) || *p == '_'))
      return false;
  return true;
}

std::vector<const dtk_option_spec*> option_specs(const dtk_plugin_entry* e) {
  std::vector<const dtk_option_spec*> out;
  if (e->num_options == 0) return out;
  const size_t stride = e->options[0].struct_size;
  for (size_t i = 0; i < e->num_options; ++i)
    out.push_back(reinterpret_cast<const dtk_option_spec*>(reinterpret_cast<const char*>(e->options) + i * stride));
  return out;
}

std::string check_option_specs(const dtk_plugin_entry* e) {
  if (e->num_options == 0) return "";
  const size_t stride = e->options[0].struct_size;
  if (!DTK_STRUCT_COVERS(dtk_option_spec, &e->options[0], 2_0))
    return "option spec struct_size " + std::to_string(stride) + " is smaller than ABI 2.0's " +
           std::to_string(dtk_option_spec_STRUCT_SIZE_2_0) + " bytes";
  const std::vector<const dtk_option_spec*> specs = option_specs(e);
  std::vector<std::string> seen;
  for (size_t i = 0; i < specs.size(); ++i) {
    const dtk_option_spec& spec = *specs[i];
    const std::string at = "option #" + std::to_string(i);
    if (spec.struct_size != stride) return at + " has a different struct_size than option #0";
    if (!valid_name(spec.name)) return at + ": invalid name (want [a-z0-9_]+)";
    const std::string name = spec.name;
    if (std::find(seen.begin(), seen.end(), name) != seen.end()) return "option '" + name + "' is declared twice";
    seen.push_back(name);
    if (spec.type < DTK_OPT_BOOL || spec.type > DTK_OPT_ENUM) return "option '" + name + "' has an unknown type";
    if (spec.type == DTK_OPT_ENUM && (!spec.choices || !*spec.choices))
      return "enum option '" + name + "' declares no choices";
    std::string why;
    if (spec.default_value && !check_value(spec, spec.default_value, &why))
      return "option '" + name + "': its default '" + std::string(spec.default_value) + "' " + why;
  }
  // Conditions last: they may name options declared after them.
  for (const dtk_option_spec* spec : specs)
    if (std::string bad = check_acts_with(*spec, specs); !bad.empty()) return bad;
  return "";
}

namespace {

// Two strings read as lists (a model's coefficients per type, "0.01, 1e-3"): the same items, each
// the same text or the same number.
bool same_items(const std::string& a, const std::string& b) {
  const std::vector<std::string> x = comma_items(a), y = comma_items(b);
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] == y[i]) continue;
    char *ex = nullptr, *ey = nullptr;
    const double u = std::strtod(x[i].c_str(), &ex), v = std::strtod(y[i].c_str(), &ey);
    if (x[i].empty() || y[i].empty() || *ex || *ey || u != v) return false;
  }
  return true;
}

}  // namespace

bool same_option_value(int32_t type, const std::string& a, const std::string& b) {
  if (a == b) return true;
  if (type == DTK_OPT_STRING) return same_items(a, b);
  if (type == DTK_OPT_INT) {  // as integers: a double would merge values 2^53 apart
    char *ea = nullptr, *eb = nullptr;
    const long long x = std::strtoll(a.c_str(), &ea, 10), y = std::strtoll(b.c_str(), &eb, 10);
    return !a.empty() && !b.empty() && !*ea && !*eb && x == y;
  }
  if (type == DTK_OPT_FLOAT) {
    char *ea = nullptr, *eb = nullptr;
    const double x = std::strtod(a.c_str(), &ea), y = std::strtod(b.c_str(), &eb);
    return !a.empty() && !b.empty() && !*ea && !*eb && x == y;
  }
  if (type == DTK_OPT_BOOL) {
    auto truth = [](const std::string& v) { return v == "true" || v == "1" || v == "True"; };  // as Options::get_bool
    return truth(a) == truth(b);
  }
  return false;
}

std::string acts_with_text(const dtk_option_spec& spec) {
  const char* text = acts_with_of(spec);
  if (!text) return "";
  std::string why, out;
  const std::vector<Alternative> alternatives = parse_acts_with(text, &why);
  // "a=x or y, or b=z": the comma keeps a setting's values apart from the next setting.
  bool several_values = false;
  for (const Alternative& a : alternatives) several_values |= a.values.size() > 1;
  for (const Alternative& a : alternatives) {
    out += (out.empty() ? "" : several_values ? ", or " : " or ") + a.setting + "=";
    for (size_t i = 0; i < a.values.size(); ++i) out += (i ? " or " : "") + a.values[i];
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> resolve_options(const Plugin& plugin,
                                                                 const std::map<std::string, std::string>& user) {
  const auto specs = plugin.options();
  const std::string who = std::string(kind_name(plugin.kind())) + " plugin '" + plugin.name() + "'";
  std::vector<std::string> names;
  for (const auto* s : specs) names.push_back(s->name);
  for (const auto& kv : user) {
    if (std::find(names.begin(), names.end(), kv.first) != names.end()) continue;
    std::string msg = who + " has no option '" + kv.first + "'";
    std::string guess = did_you_mean(kv.first, names);
    if (!guess.empty())
      msg += "; did you mean '" + guess + "'?";
    else
      msg += " (see `dtk plugins describe " + plugin.name() + "`)";
    throw HostError(msg);
  }
  std::vector<std::pair<std::string, std::string>> out;
  std::map<std::string, std::string> values;
  for (const auto* s : specs) {
    auto it = user.find(s->name);
    std::string value;
    if (it != user.end()) {
      value = it->second;
    } else if (s->default_value) {
      value = s->default_value;
    } else {
      throw HostError(who + ": required option '" + std::string(s->name) + "' is not set");
    }
    std::string why;
    if (!check_value(*s, value, &why))
      throw HostError(who + ": option '" + std::string(s->name) + "' " + why + ", got '" + value + "'");
    out.emplace_back(s->name, value);
    values[s->name] = value;
  }
  // A value the plugin would ignore is a mistake the user would not see (a stage-3 bucket size at
  // stage 2): refused, as Megatron refuses flags that do not go together.
  for (const auto* s : specs) {
    const std::string& value = values[s->name];
    if (is_default(*s, value) || acts(*s, specs, values)) continue;
    const std::string needs = acts_with_text(*s);
    const bool plain = !value.empty() && value.find_first_of(" \t'") == std::string::npos;
    throw HostError(who + ": option " + s->name + "=" + (plain ? value : "'" + value + "'") + " does nothing without " +
                    needs + ": drop it, or set " + needs);
  }
  return out;
}

void drop_idle_options(const Plugin& plugin, std::map<std::string, std::string>* options,
                       const std::vector<std::string>& keep) {
  const auto specs = plugin.options();
  // Dropping one may leave another idle (a chain of settings): until nothing changes.
  for (bool dropped = true; dropped;) {
    dropped = false;
    std::map<std::string, std::string> values;
    for (const auto* s : specs) {
      auto it = options->find(s->name);
      if (it != options->end())
        values[s->name] = it->second;
      else if (s->default_value)
        values[s->name] = s->default_value;
    }
    for (const auto* s : specs) {
      const std::string name = s->name;
      if (!options->count(name) || std::find(keep.begin(), keep.end(), name) != keep.end()) continue;
      if (acts(*s, specs, values)) continue;
      options->erase(name);
      dropped = true;
    }
  }
}

OptionValues::OptionValues(std::vector<std::pair<std::string, std::string>> kv) : kv_(std::move(kv)) {
  for (const auto& p : kv_) items_.push_back({p.first.c_str(), p.second.c_str()});
  values_ = {dtk_option_values_STRUCT_SIZE, items_.size(), items_.data()};
}

}  // namespace dtk::host
