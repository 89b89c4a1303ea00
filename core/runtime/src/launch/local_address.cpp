// See local_address.hpp.
#include "local_address.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace {

std::string numeric(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof buf);
  else if (sa->sa_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof buf);
  return buf;
}

struct IfAddrs {
  ifaddrs* list = nullptr;
  IfAddrs() {
    if (::getifaddrs(&list) != 0) list = nullptr;
  }
  ~IfAddrs() {
    if (list) ::freeifaddrs(list);
  }
};

}  // namespace

bool is_loopback_address(const std::string& a) { return a.rfind("127.", 0) == 0 || a == "::1"; }

LocalAddress local_address_towards(const std::string& host, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &res); rc != 0)
    throw HostError("distributed: " + what + " '" + host + "' does not resolve: " + ::gai_strerror(rc));
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> guard(res, ::freeaddrinfo);
  std::string last_error = "no address";
  // IPv4 first: Gloo and the store listen on both, and most clusters route IPv4.
  for (int family : {AF_INET, AF_INET6}) {
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      if (ai->ai_family != family) continue;
      const int fd = ::socket(ai->ai_family, SOCK_DGRAM, 0);
      if (fd < 0) continue;
      sockaddr_storage local{};
      socklen_t len = sizeof local;
      const bool ok = ::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
                      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
      if (!ok) last_error = std::strerror(errno);
      ::close(fd);
      if (!ok) continue;
      LocalAddress out;
      out.address = numeric(reinterpret_cast<sockaddr*>(&local));
      IfAddrs ifs;
      for (ifaddrs* i = ifs.list; i; i = i->ifa_next)
        if (i->ifa_addr && numeric(i->ifa_addr) == out.address) {
          out.interface = i->ifa_name;
          break;
        }
      return out;
    }
  }
  throw HostError("distributed: no route from this host to " + what + " '" + host + "': " + last_error);
}

std::string interface_address(const std::string& name, const std::string& what) {
  if (::if_nametoindex(name.c_str()) == 0) {
    std::vector<std::string> have;
    IfAddrs ifs;
    for (ifaddrs* i = ifs.list; i; i = i->ifa_next)
      if (std::find(have.begin(), have.end(), i->ifa_name) == have.end()) have.emplace_back(i->ifa_name);
    std::string list;
    for (const auto& h : have) list += (list.empty() ? "" : ", ") + h;
    throw HostError("distributed: " + what + " names interface '" + name + "', which this host does not have (it has: " +
                    list + ")");
  }
  std::string v6;
  IfAddrs ifs;
  for (ifaddrs* i = ifs.list; i; i = i->ifa_next) {
    if (!i->ifa_addr || name != i->ifa_name) continue;
    if (i->ifa_addr->sa_family == AF_INET) return numeric(i->ifa_addr);
    if (i->ifa_addr->sa_family == AF_INET6 && v6.empty()) v6 = numeric(i->ifa_addr);
  }
  return v6;
}

LocalAddress outward_address() {
  try {
    // A documentation address (TEST-NET-1): only the default route leads there; nothing is sent.
    const LocalAddress via_default = local_address_towards("192.0.2.1", "the default route");
    if (!is_loopback_address(via_default.address)) return via_default;
  } catch (const HostError&) {
  }
  IfAddrs ifs;
  for (int family : {AF_INET, AF_INET6})
    for (ifaddrs* i = ifs.list; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != family || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK))
        continue;
      const std::string a = numeric(i->ifa_addr);
      if (family == AF_INET6 && a.rfind("fe80", 0) == 0) continue;  // link-local needs a scope
      return LocalAddress{i->ifa_name, a};
    }
  throw HostError("distributed: this host has no network interface other than the loopback");
}

}  // namespace dtk::core
