#include "monarch/runtime/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>

#include <c10/util/Exception.h>


#include "monarch/runtime/log.h"

namespace monarch {

namespace {

constexpr int64_t kPage = 4096;

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
  std::string problem;
  uint64_t tag = 0;
  int64_t owner_pid = -1, owner_fd = -1;

  // Rank 0 creates an anonymous memory file (memfd: it has no name, so nothing can be left in
  // /dev/shm whatever happens to the processes) and tells the others where to open it: its
  // pid and descriptor, through /proc. Rank 0 keeps the descriptor open until every rank
  // has mapped it (or given up).
  struct Descriptor {
    int fd = -1;
    ~Descriptor() {
      if (fd >= 0) close(fd);
    }
  } created;
  auto message = at::full({3}, -1, at::kLong);  // pid, fd, tag (bits)
  if (me == 0 && enabled()) {
    std::random_device random;
    tag = ((static_cast<uint64_t>(random()) << 32) ^ random() ^ static_cast<uint64_t>(getpid())) | 1;
    created.fd = static_cast<int>(syscall(SYS_memfd_create, "monarch-node-buffer", 1u /* MFD_CLOEXEC */));
    if (created.fd < 0) {
      problem = errno_text("memfd_create");
    } else if (const int rc = posix_fallocate(created.fd, 0, total); rc != 0) {
      // Reserving the pages now: too little shared memory fails here, not with a SIGBUS at
      // the first write.
      problem = std::string("posix_fallocate of ") + std::to_string(total) + " bytes: " + std::strerror(rc);
    } else {
      mapping->base = mmap(nullptr, mapping->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, created.fd, 0);
      if (mapping->base == MAP_FAILED) problem = errno_text("mmap");
    }
    if (problem.empty()) {
      std::memcpy(mapping->base, &tag, sizeof tag);
      auto* m = message.data_ptr<int64_t>();
      m[0] = getpid();
      m[1] = created.fd;
      std::memcpy(&m[2], &tag, sizeof tag);
    }
  }
  intra.broadcast(message, 0).wait();
  if (me != 0) {
    const auto* m = message.data_ptr<int64_t>();
    owner_pid = m[0];
    owner_fd = m[1];
    std::memcpy(&tag, &m[2], sizeof tag);
    if (owner_pid < 0) {
      problem = "rank 0 of the node did not create it (see its log)";
    } else if (!enabled()) {
      problem = "MONARCH_SHARED_MEMORY=off on this rank";
    } else {
      const std::string path = "/proc/" + std::to_string(owner_pid) + "/fd/" + std::to_string(owner_fd);
      const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      struct stat st {};
      if (fd < 0) {
        problem = errno_text(("open " + path).c_str());  // e.g. rank 0 on another host
      } else if (fstat(fd, &st) != 0 || st.st_size != total) {
        problem = path + " is not rank 0's buffer (another size)";
      } else {
        mapping->base = mmap(nullptr, mapping->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (mapping->base == MAP_FAILED) problem = errno_text("mmap");
      }
      if (fd >= 0) close(fd);
      uint64_t seen = 0;
      if (problem.empty()) std::memcpy(&seen, mapping->base, sizeof seen);
      if (problem.empty() && seen != tag) problem = path + " is not rank 0's buffer (another host?)";
    }
  }
  // Every rank learns whether every rank mapped it.
  auto failed = at::full({1}, problem.empty() ? 0.0f : 1.0f, at::kFloat);
  intra.all_reduce_max(failed).wait();
  if (failed.item<float>() != 0.0f) {
    if (!problem.empty()) {
      log::info("mesh", "group ", intra.name(), ": no shared memory between the node's ranks: ", problem,
                "; the intra-node steps use the group's collectives");
    }
    return nullptr;
  }
  auto out = std::shared_ptr<NodeSharedBuffer>(new NodeSharedBuffer());
  out->mapping_ = mapping;
  out->numel_ = numel;
  out->me_ = me;
  out->tag_ = tag;
  // One tensor over all the slots (its storage holds the mapping: a slot handed out lives as
  // long as the memory under it), the slots views of it.
  const int64_t slot_elements = slot_bytes / static_cast<int64_t>(c10::elementSize(dtype));
  at::Tensor all = at::from_blob(static_cast<uint8_t*>(mapping->base) + kPage, {slot_elements * intra.size()},
                                 [mapping](void*) {}, at::TensorOptions().dtype(dtype));
  for (int i = 0; i < intra.size(); ++i) out->slots_.push_back(all.narrow(0, i * slot_elements, numel));
  return out;
}

NodeSharedBuffer::~NodeSharedBuffer() = default;

namespace {

// A barrier that also checks that every rank is at the same phase of the same buffer: a rank
// whose previous step failed midway must not read a slot another rank is still filling. The
// group's maximum of (id, -id) is (id, -id) only if every rank passed the same id; a mismatch
// is an error on every rank.
void agree_on(Communicator& intra, const NodeSharedBuffer& shared, int phase, const char* what) {
  Communicator::Phase scope(intra, what);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const double id = static_cast<double>((shared.tag() >> 13) * 4 + static_cast<uint64_t>(phase));  // < 2^53: exact
  auto both = at::tensor({id, -id}, at::kDouble);
  intra.all_reduce_max(both).wait();
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const auto* v = both.data_ptr<double>();
  TORCH_CHECK(v[0] == id && v[1] == -id, "monarch: ", what, " on group ", intra.name(), ": rank ",
              intra.global_rank(), " is at another buffer or phase than another rank of the node (an earlier step "
              "failed on some ranks?); the shared slots are not read");
}

}  // namespace

void shared_reduce_scatter_all_gather(Communicator& intra, const NodeSharedBuffer& shared, at::Tensor& sum_scratch,
                                      const std::function<void(at::Tensor shard)>& between_nodes) {
  const int64_t local = shared.slots();
  TORCH_CHECK(local == intra.size(), "monarch: shared buffer of ", local, " slots for a group of ", intra.size());
  TORCH_CHECK(shared.numel() % local == 0, "monarch: shared buffer of ", shared.numel(), " values over ", local,
              " ranks: pad it to a multiple of ", local);
  const int64_t n = shared.numel() / local;
  const int me = intra.group_rank();
  const auto chunk = [&](int slot, int64_t index) { return shared.slot(slot).narrow(0, index * n, n); };
  at::NoGradGuard no_grad;
  agree_on(intra, shared, 1, "hierarchical all-reduce: gradients in the node's shared slots");
  // Reduce-scatter: chunk `me` of every slot, summed as the collective path sums the chunks
  // it receives (Communicator::reduce_scatter: sum over dim 0 of [L, n], fp32 for
  // low-precision dtypes), so both paths give bitwise the same values. The slots are evenly
  // spaced in the mapping, so the L chunks are one strided [L, n] view.
  at::Tensor shard = chunk(me, me);
  const at::ScalarType dtype = shard.scalar_type();
  const at::ScalarType wide = at::promote_types(dtype, at::kFloat);
  const int64_t spacing =
      static_cast<const uint8_t*>(shared.slot(1).data_ptr()) - static_cast<const uint8_t*>(shared.slot(0).data_ptr());
  const at::Tensor rows = chunk(0, me).as_strided({local, n}, {spacing / static_cast<int64_t>(shard.element_size()), 1});
  if (!sum_scratch.defined() || sum_scratch.numel() < n || sum_scratch.scalar_type() != wide) {
    sum_scratch = at::empty({n}, shard.options().dtype(wide));
  }
  at::Tensor sum = sum_scratch.narrow(0, 0, n);
  at::sum_out(sum, dtype == wide ? rows : rows.to(wide), {0});
  shard.copy_(sum);
  between_nodes(shard);
  agree_on(intra, shared, 2, "hierarchical all-reduce: reduced chunks in the node's shared slots");
  // All-gather: the other chunks from their owners' slots.
  for (int j = 0; j < local; ++j) {
    if (j != me) chunk(me, j).copy_(chunk(j, j));
  }
  // No rank overwrites its slot (the next step's gradients) while another still reads it.
  agree_on(intra, shared, 3, "hierarchical all-reduce: shared slots read");
}

}  // namespace monarch
