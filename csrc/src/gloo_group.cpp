// Gloo process groups (gloo_group.h): the only file that includes ProcessGroupGloo.hpp.
#include "monarch/runtime/gloo_group.h"

#include <cstdlib>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace monarch::gloo_group {

DevicePtr device_from_environment(bool loopback) {
  const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
  if (iface != nullptr && *iface != '\0') return c10d::ProcessGroupGloo::createDeviceForInterface(iface);
  if (loopback) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

compat::BackendPtr connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, const DevicePtr& device) {
  TORCH_INTERNAL_ASSERT(device, "gloo_group::connect: no transport device");
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(device);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

std::chrono::milliseconds timeout(const compat::BackendPtr& group) {
  auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(group.get());
  TORCH_INTERNAL_ASSERT(gloo != nullptr, "gloo_group::timeout: the group is not a Gloo group");
  return gloo->getOptions()->timeout;
}

}  // namespace monarch::gloo_group
