#pragma once
// Gloo process groups over a c10d store. gloo_group.cpp is the one file of the runtime that
// includes c10d's ProcessGroupGloo.hpp and, through it, gloo's own headers: torch's wheels
// ship gloo compiled into libtorch_cpu but not its headers, which Debian's libgloo-dev
// provides. Only pointers to gloo objects cross this header, so their layout never matters
// to the rest of the runtime.
#include <chrono>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "monarch/runtime/compat.h"

namespace gloo::transport {
class Device;
}

namespace monarch::gloo_group {

using DevicePtr = std::shared_ptr<::gloo::transport::Device>;

// The transport device: on the interface GLOO_SOCKET_IFNAME names if it is set, else on
// loopback when every rank is on this machine (`loopback`), else on the host's address.
DevicePtr device_from_environment(bool loopback);

// A Gloo group of `size` ranks over `store` (keys unique to the group are the caller's:
// a PrefixStore), this process being `rank`. Throws what c10d throws when a peer does not
// connect within `timeout`.
compat::BackendPtr connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, const DevicePtr& device);

// The timeout `group` was connected with (every Gloo operation's deadline).
std::chrono::milliseconds timeout(const compat::BackendPtr& group);

}  // namespace monarch::gloo_group
