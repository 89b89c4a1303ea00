// Which local address a rank's Gloo device binds to, and so advertises to its peers.
//
// Gloo's default device binds to the address the hostname resolves to. On Debian and in most
// containers /etc/hosts maps the hostname to 127.0.0.1, so every rank would advertise the
// loopback to ranks on other hosts, and they could never connect. DTK instead asks the routing
// table: the local address of a connection towards MASTER_ADDR (a UDP connect() sends nothing)
// is the address of the interface the peers are reached through.
#pragma once

#include <string>
#include <vector>

namespace dtk::core {

struct LocalAddress {
  std::string interface;  // e.g. "eth0" ("" when no interface holds the address)
  std::string address;    // numeric, e.g. "192.168.77.2"
};

// The local end of a route to `host` (a name or a numeric address). Throws HostError naming
// `what` (e.g. "MASTER_ADDR") when the host does not resolve or no route leads to it.
LocalAddress local_address_towards(const std::string& host, const std::string& what);

// The first IPv4 (else IPv6) address of interface `name`; "" when it has none. Throws HostError
// when this host has no interface of that name, listing those it has.
std::string interface_address(const std::string& name, const std::string& what);

bool is_loopback_address(const std::string& numeric_address);

// This host's address towards other hosts when MASTER_ADDR cannot tell (the master node, whose
// own name resolves to the loopback): the local end of the default route, else the first
// non-loopback interface that is up. Throws HostError when the host has none.
LocalAddress outward_address();

}  // namespace dtk::core
