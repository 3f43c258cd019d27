#include "monarch/runtime/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>

#include <c10/util/Exception.h>

#include <spdlog/spdlog.h>

#include "monarch/runtime/log.h"

namespace monarch {

namespace {

constexpr int64_t kPage = 4096;
constexpr int64_t kNameBytes = 96;  // the broadcast: name (NUL-terminated), then the tag

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

// One mapping of the whole segment: a header page (the creator's tag), then one page-aligned
// slot per rank.
struct NodeSharedBuffer::Mapping {
  void* base = MAP_FAILED;
  size_t bytes = 0;
  ~Mapping() {
    if (base != MAP_FAILED) munmap(base, bytes);
  }
};

bool NodeSharedBuffer::enabled() {
  const char* value = std::getenv("MONARCH_SHARED_MEMORY");
  if (value == nullptr) return true;
  const std::string v(value);
  return !(v == "off" || v == "0" || v == "false" || v == "no");
}

std::shared_ptr<NodeSharedBuffer> NodeSharedBuffer::create(Communicator& intra, int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "monarch: shared buffer of ", numel, " elements");
  if (intra.size() == 1) return nullptr;  // nothing to share
  const int me = intra.group_rank();
  const int64_t slot_bytes = round_up(std::max<int64_t>(numel, 1) * static_cast<int64_t>(c10::elementSize(dtype)), kPage);
  const int64_t total = kPage + slot_bytes * intra.size();
  auto mapping = std::make_shared<Mapping>();
  mapping->bytes = static_cast<size_t>(total);
  std::string name, problem;
  uint64_t tag = 0;

  // Rank 0 creates the segment and broadcasts its name and tag (empty name: it could not).
  auto message = at::zeros({kNameBytes + 8}, at::kByte);
  if (me == 0 && enabled()) {
    std::random_device random;
    tag = (static_cast<uint64_t>(random()) << 32) ^ random() ^ static_cast<uint64_t>(getpid());
    std::ostringstream os;
    os << "/monarch-" << getpid() << "-" << std::hex << tag;
    name = os.str();
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      problem = errno_text("shm_open");
      name.clear();
    } else {
      // posix_fallocate reserves the pages now: too small a /dev/shm fails here, not with a
      // SIGBUS at the first write.
      const int rc = posix_fallocate(fd, 0, total);
      if (rc != 0) {
        problem = std::string("posix_fallocate of ") + std::to_string(total) + " bytes: " + std::strerror(rc);
      } else {
        mapping->base = mmap(nullptr, mapping->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (mapping->base == MAP_FAILED) problem = errno_text("mmap");
      }
      close(fd);
      if (!problem.empty()) {
        shm_unlink(name.c_str());
        name.clear();
      } else {
        std::memcpy(mapping->base, &tag, sizeof tag);
      }
    }
    auto* bytes = message.data_ptr<uint8_t>();
    std::memcpy(bytes, name.c_str(), std::min<size_t>(name.size(), kNameBytes - 1));
    std::memcpy(bytes + kNameBytes, &tag, sizeof tag);
  }
  // The creator removes the name whatever happens next (a peer that died, a failed check):
  // the mappings keep the memory, and nothing is left in /dev/shm.
  struct Unlink {
    std::string name;
    ~Unlink() {
      if (!name.empty()) shm_unlink(name.c_str());
    }
  } unlink{me == 0 ? name : std::string()};

  intra.broadcast(message, 0).wait();
  if (me != 0) {
    const auto* bytes = message.data_ptr<uint8_t>();
    name.assign(reinterpret_cast<const char*>(bytes), strnlen(reinterpret_cast<const char*>(bytes), kNameBytes));
    std::memcpy(&tag, bytes + kNameBytes, sizeof tag);
    if (name.empty()) {
      problem = "rank 0 of the node could not create it";
    } else if (!enabled()) {
      problem = "MONARCH_SHARED_MEMORY=off on this rank";
    } else {
      const int fd = shm_open(name.c_str(), O_RDWR, 0600);
      struct stat st {};
      if (fd < 0) {
        problem = errno_text("shm_open");  // e.g. another host: the ranks were not on one node
      } else if (fstat(fd, &st) != 0 || st.st_size != total) {
        problem = "segment " + name + " has another size";
      } else {
        mapping->base = mmap(nullptr, mapping->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (mapping->base == MAP_FAILED) problem = errno_text("mmap");
      }
      if (fd >= 0) close(fd);
      uint64_t seen = 0;
      if (problem.empty()) std::memcpy(&seen, mapping->base, sizeof seen);
      if (problem.empty() && seen != tag) problem = "segment " + name + " is not rank 0's (another host?)";
    }
  }
  // Every rank learns whether every rank mapped it.
  auto failed = at::full({1}, problem.empty() ? 0.0f : 1.0f, at::kFloat);
  intra.all_reduce_max(failed).wait();
  if (failed.item<float>() != 0.0f) {
    log::get("mesh").info("group {}: no shared memory between the node's ranks{}{}; the intra-node steps use the "
                          "group's collectives",
                          intra.name(), problem.empty() ? "" : ": ", problem);
    return nullptr;
  }
  auto out = std::shared_ptr<NodeSharedBuffer>(new NodeSharedBuffer());
  out->mapping_ = mapping;
  out->numel_ = numel;
  out->me_ = me;
  auto* base = static_cast<uint8_t*>(mapping->base) + kPage;
  for (int i = 0; i < intra.size(); ++i) {
    // The tensors hold the mapping: a slot handed out lives as long as the memory under it.
    out->slots_.push_back(at::from_blob(base + i * slot_bytes, {numel}, [mapping](void*) {},
                                        at::TensorOptions().dtype(dtype)));
  }
  return out;
}

NodeSharedBuffer::~NodeSharedBuffer() = default;

void shared_reduce_scatter_all_gather(Communicator& intra, const NodeSharedBuffer& shared,
                                      const std::function<void(at::Tensor shard)>& between_nodes) {
  const int64_t local = shared.slots();
  TORCH_CHECK(local == intra.size(), "monarch: shared buffer of ", local, " slots for a group of ", intra.size());
  TORCH_CHECK(shared.numel() % local == 0, "monarch: shared buffer of ", shared.numel(), " values over ", local,
              " ranks: pad it to a multiple of ", local);
  const int64_t n = shared.numel() / local;
  const int me = intra.group_rank();
  const auto chunk = [&](int slot, int64_t index) { return shared.slot(slot).narrow(0, index * n, n); };
  at::NoGradGuard no_grad;
  {
    Communicator::Phase phase(intra, "hierarchical all-reduce: gradients in the node's shared slots");
    std::atomic_thread_fence(std::memory_order_seq_cst);
    intra.barrier();
  }
  // Reduce-scatter: chunk `me` of every slot, summed in group order into this rank's slot
  // (the same order and precision as the collective path's sum over received chunks).
  at::Tensor shard = chunk(me, me);
  const at::ScalarType dtype = shard.scalar_type();
  const bool widen = dtype != at::kFloat && dtype != at::kDouble;
  if (widen) {
    auto sum = chunk(0, me).to(at::kFloat);
    for (int j = 1; j < local; ++j) sum.add_(chunk(j, me).to(at::kFloat));
    shard.copy_(sum);
  } else {
    // out may alias an input (shard is slot me's chunk): elementwise, each element read first.
    at::add_out(shard, chunk(0, me), chunk(1, me));
    for (int j = 2; j < local; ++j) shard.add_(chunk(j, me));
  }
  between_nodes(shard);
  {
    Communicator::Phase phase(intra, "hierarchical all-reduce: reduced chunks in the node's shared slots");
    std::atomic_thread_fence(std::memory_order_seq_cst);
    intra.barrier();
  }
  // All-gather: the other chunks from their owners' slots.
  for (int j = 0; j < local; ++j) {
    if (j != me) chunk(me, j).copy_(chunk(j, j));
  }
  Communicator::Phase phase(intra, "hierarchical all-reduce: shared slots read");
  std::atomic_thread_fence(std::memory_order_seq_cst);
  intra.barrier();
}

}  // namespace monarch
