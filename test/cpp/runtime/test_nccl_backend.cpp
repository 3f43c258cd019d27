// The NCCL backend behind the Communicator, as far as a machine without a GPU checks it: the
// dtype mapping, that the runtime links NCCL (ncclGetVersion needs no GPU), that creating a
// communicator without a GPU fails naming the CUDA call, and the Communicator's CUDA-tensor
// routing (mixed CPU/CUDA, the device in the fingerprint, the failure latch; a build without
// NCCL says so). "CUDA tensors" here wrap host memory (at::for_blob with a CUDA device): this
// LibTorch has no CUDA, and no kernel ever touches them. With a GPU, the second test instead
// runs a one-rank communicator on real device memory (nothing here has ever run on a GPU).
#include "catch_with_torch.h"

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include "monarch/runtime/gloo_group.h"

#include "monarch/runtime/communicator.h"
#ifdef MONARCH_WITH_NCCL
#include <cuda_runtime_api.h>

#include "monarch/runtime/nccl_backend.h"
#endif

using Catch::Contains;
using monarch::Communicator;

namespace {

// A tensor that claims to live on cuda:0 and points at `host` (never dereferenced as device
// memory: the tests only reach code that reads its pointer, size, dtype and device).
at::Tensor fake_cuda(std::vector<float>& host) {
  const auto options = at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, 0));
  return at::for_blob(host.data(), {static_cast<int64_t>(host.size())})
      .options(options)
      .target_device(at::Device(at::kCUDA, 0))
      .make_tensor();
}

// What a rank observed, by name (Catch2 assertions are not thread-safe: the ranks record,
// the test thread checks).
using Seen = std::map<std::string, std::string>;

// `n` ranks in this process, one thread each, with Communicators over Gloo groups on one
// HashStore under `prefix`. Returns each rank's observations; "uncaught" holds what its
// `body` threw, if anything.
std::vector<Seen> run_group(int n, const std::string& prefix, const std::function<void(Communicator&, int, Seen&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<Seen> seen(n);
  std::vector<std::thread> threads;
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(r);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r]() {
      try {
        auto pg = monarch::gloo_group::connect(c10::make_intrusive<c10d::PrefixStore>(prefix + "/gloo", store), r, n,
                                      std::chrono::seconds(20), monarch::gloo_group::device_from_environment(true));
        Communicator comm(pg, ranks, r, prefix, store, prefix);
        body(comm, r, seen[r]);
      } catch (const c10::Error& e) {
        seen[r]["uncaught"] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        seen[r]["uncaught"] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return seen;
}

std::string yes(bool b) { return b ? "yes" : "no"; }

std::string message_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

#ifdef MONARCH_WITH_NCCL
// Whether a usable GPU is here; `status` gets cudaGetDeviceCount's result.
bool have_gpu(cudaError_t* status = nullptr) {
  int count = 0;
  const cudaError_t s = cudaGetDeviceCount(&count);
  if (status != nullptr) *status = s;
  return s == cudaSuccess && count > 0;
}
#endif

}  // namespace

#ifdef MONARCH_WITH_NCCL

TEST_CASE("NCCL: dtype mapping, and the runtime links the NCCL library", "[nccl]") {
  using monarch::nccl_dtype;
  CHECK(nccl_dtype(at::kFloat) == ncclFloat32);
  CHECK(nccl_dtype(at::kDouble) == ncclFloat64);
  CHECK(nccl_dtype(at::kHalf) == ncclFloat16);
  CHECK(nccl_dtype(at::kBFloat16) == ncclBfloat16);
  CHECK(nccl_dtype(at::kChar) == ncclInt8);
  CHECK(nccl_dtype(at::kByte) == ncclUint8);
  CHECK(nccl_dtype(at::kInt) == ncclInt32);
  CHECK(nccl_dtype(at::kLong) == ncclInt64);
  CHECK_THROWS_WITH(nccl_dtype(at::kBool), Contains("NCCL has no data type for Bool"));
  CHECK_THROWS_WITH(nccl_dtype(at::kComplexFloat), Contains("NCCL has no data type for ComplexFloat"));

  // ncclGetVersion through monarch_runtime: the library is linked and loads without a GPU.
  // Codes are major*10000 + minor*100 + patch since 2.9; ncclAvg and bf16 need 2.10.
  const int version = monarch::nccl_version();
  INFO("NCCL " << version << ", header " << NCCL_VERSION_CODE);
  CHECK(version / 10000 == NCCL_MAJOR);
  CHECK(version >= 21000);
}

TEST_CASE("NCCL: creating a communicator without a GPU names the failing CUDA call", "[nccl]") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  cudaError_t status = cudaSuccess;
  if (!have_gpu(&status)) {
    const std::string text = message_of([&] {
      monarch::NcclBackend::create({0}, 0, 0, store, "solo", "solo", std::chrono::seconds(5));
    });
    INFO(text);
    CHECK_THAT(text, Contains("rank 0: creating the NCCL communicator on group 'solo'"));
    if (status != cudaSuccess) {
      CHECK_THAT(text, Contains(std::string("cudaGetDeviceCount(&devices) failed: ") + cudaGetErrorString(status)));
    } else {
      CHECK_THAT(text, Contains("device cuda:0 does not exist (0 CUDA devices)"));
    }
    return;
  }
  // A GPU (never run so far): a one-rank communicator on real device memory.
  auto nccl = monarch::NcclBackend::create({0}, 0, 0, store, "solo", "solo", std::chrono::seconds(30));
  std::vector<float> host{1, 2, 3, 4}, back(8, 0);
  float* a = nullptr;
  float* b = nullptr;
  REQUIRE(cudaMalloc(&a, 4 * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(&b, 8 * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMemcpy(a, host.data(), 4 * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  nccl->all_reduce(a, a, 4, ncclFloat32, ncclSum, nullptr)->wait();
  nccl->all_reduce(a, a, 4, ncclFloat32, ncclAvg, nullptr)->wait();
  nccl->all_gather(a, b, 4, ncclFloat32, nullptr)->wait();
  nccl->send_recv_group({{true, a, 4, ncclFloat32, 0}, {false, b + 4, 4, ncclFloat32, 0}}, nullptr)->wait();
  REQUIRE(cudaMemcpy(back.data(), b, 8 * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(back == std::vector<float>{1, 2, 3, 4, 1, 2, 3, 4});
  cudaFree(a);
  cudaFree(b);
}

TEST_CASE("NCCL: a rank on CUDA and one on CPU fail the fingerprint, naming the device", "[nccl]") {
  const auto seen = run_group(2, "devices", [](Communicator& comm, int rank, Seen& out) {
    std::vector<float> host(4, 1.0f);
    auto buffer = rank == 1 ? fake_cuda(host) : at::ones({4});
    out["error"] = message_of([&] { comm.all_reduce(buffer).wait(); });
    out["failed"] = yes(comm.failed());
    out["nccl"] = yes(comm.uses_nccl());
  });
  for (int rank = 0; rank < 2; ++rank) {
    auto s = seen[rank];
    const bool threw = s.count("uncaught") != 0;  // before s[...] below adds the key
    INFO("rank " << rank << ": " << s["uncaught"] << s["error"]);
    CHECK_FALSE(threw);
    CHECK_THAT(s["error"], Contains("the ranks of group 'devices' are not making the same collective call"));
    CHECK_THAT(s["error"], Contains("rank 0: all_reduce (sum) of 4 Float in a direct call"));
    CHECK_THAT(s["error"], Contains("rank 1: all_reduce (sum) of 4 Float on CUDA in a direct call"));
    CHECK(s["failed"] == "yes");
    CHECK(s["nccl"] == "no");
  }
}

#endif  // MONARCH_WITH_NCCL

TEST_CASE("NCCL: CUDA tensors in the Communicator: mixed devices, and no NCCL or no GPU, are clear errors",
          "[nccl]") {
#ifdef MONARCH_WITH_NCCL
  if (have_gpu()) {
    WARN("a GPU is present: the fake CUDA tensors of this test would reach NCCL; skipped");
    return;
  }
#endif
  const auto seen = run_group(2, "g", [](Communicator& comm, int rank, Seen& out) {
    std::vector<float> host(8, 1.0f), host2(4, 1.0f);
    // Mixed: a local error naming the op, before any exchange; the group stays usable.
    out["mixed"] = message_of([&] { comm.all_gather(fake_cuda(host), at::ones({4})).wait(); });
    out["failed after mixed"] = yes(comm.failed());
    auto cpu = at::full({2}, static_cast<float>(rank + 1));
    comm.all_reduce(cpu).wait();
    out["cpu sum"] = std::to_string(cpu[0].item<float>());
    // A CUDA collective.
    out["cuda"] = message_of([&] { comm.all_reduce(fake_cuda(host2)).wait(); });
    out["failed after cuda"] = yes(comm.failed());
    out["nccl"] = yes(comm.uses_nccl());
    out["later"] = message_of([&] { comm.all_reduce(at::ones({2})).wait(); });
  });
  for (int rank = 0; rank < 2; ++rank) {
    auto s = seen[rank];
    const std::string me = "rank " + std::to_string(rank) + ": ";
    const bool threw = s.count("uncaught") != 0;  // before s[...] below adds the key
    INFO(me << s["uncaught"] << "\nmixed: " << s["mixed"] << "\ncuda: " << s["cuda"] << "\nlater: " << s["later"]);
    CHECK_FALSE(threw);
    CHECK_THAT(s["mixed"], Contains(me + "all_gather on group 'g' got both CPU and CUDA tensors"));
    CHECK(s["failed after mixed"] == "no");
    CHECK(s["cpu sum"] == std::to_string(3.0f));
    CHECK(s["nccl"] == "no");
#ifdef MONARCH_WITH_NCCL
    // Built with NCCL, no GPU: the lazy communicator creation fails naming the op and the call.
    CHECK_THAT(s["cuda"], Contains(me + "all_reduce of 4 Float on group 'g' (ranks 0 1)"));
    CHECK_THAT(s["cuda"], Contains("creating the NCCL communicator"));
    CHECK_THAT(s["cuda"], Contains("cudaGetDeviceCount"));
    CHECK(s["failed after cuda"] == "yes");
    // The latch: later calls, CPU ones included, fail with that first error.
    CHECK_THAT(s["later"], Contains("cannot be used after a failed collective"));
    CHECK_THAT(s["later"], Contains("cudaGetDeviceCount"));
#else
    CHECK_THAT(s["cuda"], Contains(me + "all_reduce on group 'g' got CUDA tensors, but torch_monarch was built "
                                        "without NCCL: rebuild with CUDA and NCCL"));
    CHECK(s["failed after cuda"] == "no");
    CHECK(s["later"] == "(no exception)");
#endif
  }
}
