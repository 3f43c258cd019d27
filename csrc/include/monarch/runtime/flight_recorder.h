#pragma once
// The collective flight recorder (after PyTorch's NCCL flight recorder): every collective a
// communicator issues is noted in a process-wide ring (group, the call's number on that
// group, operation, element count, dtype, the caller's phase and step, when). When a
// collective fails or times out, an agreement or entry check fails, or the launcher sends
// SIGTERM, the ring is written to $MONARCH_FLIGHT_RECORDER_DIR/rank<R>.json (nothing is
// written when the variable is unset); `python -m torch_monarch hangs DIR` merges the ranks'
// dumps and names the first call where they diverged (torch_monarch/hangs.py).
//
// Announcements: a rank entering an operation only some ranks might call (a state dict,
// Communicator::expect_all) writes what it is doing to the job's store. A rank whose
// collective fails, or that is terminated, reads its groups' announcements and says which
// ranks are elsewhere and where ("rank 0 is in state_dict() ...").
//
// Environment: MONARCH_FLIGHT_RECORDER_DIR (dump directory), MONARCH_FLIGHT_RECORDER_CALLS
// (ring size, default 4096 calls).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace monarch::flight {

// The group a call went to, shared by all its records.
struct CallGroup {
  std::string name;  // the group's name ("dp")
  std::string key;   // the group's store prefix: tells groups of the same name apart
  std::vector<int> ranks;
};

// One issued collective. Recording one allocates nothing: the group is shared, the names are
// static strings and the ring's slots are made once. (A ring of 4096 records holding their
// own small strings and rank lists, replaced call by call, left long-lived small chunks among
// each step's tensors and fragmented glibc's heap: the TP-4 SP bench's RSS grew by ~6 MiB a
// step, against ~2 MiB with a one-call ring.)
struct Call {
  std::shared_ptr<const CallGroup> group;
  int64_t seq = 0;           // the call's number on this group, from 0
  const char* op = "";       // static strings
  int64_t numel = 0;
  const char* dtype = "";
  const char* phase = "";
  int64_t step = 0;
  int64_t time_ns = 0;  // system clock, when issued
};

void set_rank(int rank);
void record(const Call& call);
std::vector<Call> snapshot();  // oldest first

// Writes this rank's ring and `reason` to $MONARCH_FLIGHT_RECORDER_DIR/rank<R>.json; returns
// the path written, or "" when the variable is unset (or the write failed: logged).
std::string dump(const std::string& reason);

// Where a group's announcements live, for reading them from any thread (the store calls
// capture the job's store; communicator.cpp builds them).
struct GroupInfo {
  std::string name;
  std::string key;
  std::vector<int> ranks;
  int global_rank = 0;
  std::function<bool(const std::string&)> check;               // store->check({key})
  std::function<std::string(const std::string&)> get;          // store->get(key)
  std::function<void(const std::string&, const std::string&)> set;
};
void register_group(const std::shared_ptr<GroupInfo>& group);  // kept as a weak reference

// This rank announces `doing` on `group` ("state_dict() (call #0 on group 'dp')").
void announce(const GroupInfo& group, const std::string& doing);
void withdraw(const GroupInfo& group);
// What the other members announced, as text ("" when none did): "rank 0 is in state_dict()
// (call #0 on group 'dp'): every rank must call it."
std::string others(const GroupInfo& group);

// Once per process: on SIGTERM (the launcher stopping the job after another rank failed),
// says what this rank was doing and what the others announced, dumps the ring, and dies of
// SIGTERM as it would have. Only installed when SIGTERM has its default action.
void install_termination_report();

}  // namespace monarch::flight
