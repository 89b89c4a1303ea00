// A TCP port on 127.0.0.1 held for MASTER_PORT in multi-process tests: keep the object alive until
// the ranks exit, so a test launched at the same time cannot be given the same port
// (dtk/core/launch/reserved_port.hpp says why the store can still listen on it).
#pragma once

#include "dtk/core/launch/reserved_port.hpp"

namespace dtk_test {

using ReservedPort = dtk::core::ReservedPort;

}  // namespace dtk_test
