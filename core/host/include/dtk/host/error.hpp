// dtk/host/error.hpp — the one exception type of the host side (core/host, core/runtime, apps):
// every failure the user must see, as one line, no stack trace. main() prints
// "dtk: error: <what()>" and exits non-zero. Its own header so that code which only reports
// errors does not include the plugin loader.
#pragma once

#include <stdexcept>

namespace dtk::host {

class HostError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace dtk::host
