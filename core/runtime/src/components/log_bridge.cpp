#include "log_bridge.hpp"

#include <dtk/abi.h>
#include <glog/logging.h>

#include <string>

namespace dtk::core {

void log_to_glog(void*, int32_t level, const char* plugin, const char* file, int32_t line, const char* message) {
  const char* base = file ? file : "plugin";
  const int line_no = line > 0 ? line : 0;
  const std::string prefix = plugin ? std::string("[") + plugin + "] " : std::string();
  switch (level) {
    case DTK_LOG_DEBUG:
      if (VLOG_IS_ON(1)) google::LogMessage(base, line_no, google::GLOG_INFO).stream() << prefix << message;
      break;
    case DTK_LOG_WARNING:
      google::LogMessage(base, line_no, google::GLOG_WARNING).stream() << prefix << message;
      break;
    case DTK_LOG_ERROR:
      google::LogMessage(base, line_no, google::GLOG_ERROR).stream() << prefix << message;
      break;
    default:
      google::LogMessage(base, line_no, google::GLOG_INFO).stream() << prefix << message;
  }
}

}  // namespace dtk::core
