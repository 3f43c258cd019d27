#include "monarch/runtime/pipeline.h"


#include "monarch/runtime/log.h"
#include "monarch/runtime/trace.h"

#include <set>

#include <chrono>
#include <climits>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include "monarch/planner/errors.h"

namespace monarch {

using planner::Action;
using planner::ActionType;

namespace {

// Since torch 2.0, capturing a leaf's gradient with autograd::grad runs the tensor hooks
// registered on it (Tensor.register_hook). The zero-bubble input pass (B) only captures the
// parameters' gradients; the weight pass (W) hands them to autograd, where the hooks and the
// accumulators run. Parking the hooks during B keeps them to one call per step, in W, as a
// plain backward makes them.
class ParkedTensorHooks {
 public:
  explicit ParkedTensorHooks(const std::vector<at::Tensor>& leaves) {
    parked_.reserve(leaves.size());  // no reallocation may throw once a hook is parked
    for (const auto& leaf : leaves) {
      auto accumulator = torch::autograd::impl::try_get_grad_accumulator(leaf);
      if (!accumulator || accumulator->tensor_pre_hooks().empty()) continue;
      parked_.emplace_back(accumulator, std::move(accumulator->tensor_pre_hooks()));
      accumulator->tensor_pre_hooks().clear();
    }
  }
  ~ParkedTensorHooks() {
    for (auto& [accumulator, hooks] : parked_) {
      auto& now = accumulator->tensor_pre_hooks();  // hooks registered meanwhile run after
      for (auto& hook : now) hooks.push_back(std::move(hook));
      now = std::move(hooks);
    }
  }
  ParkedTensorHooks(const ParkedTensorHooks&) = delete;
  ParkedTensorHooks& operator=(const ParkedTensorHooks&) = delete;

 private:
  std::vector<std::pair<compat::NodePtr, std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>>>> parked_;
};

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Up to 16 tensors per message; slot 16 carries the shapes.
constexpr int kTensorSlots = 16;
constexpr int kMetaSlot = kTensorSlots;
constexpr int kSlots = kTensorSlots + 1;
constexpr int64_t kMetaLen = 256;

uint64_t fingerprint(const planner::Schedule& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over every field
  auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<int64_t>(s.kind));
  mix(s.ranks);
  mix(s.virtual_stages);
  mix(s.micro_batches);
  for (const auto& prog : s.per_rank) {
    mix(static_cast<int64_t>(prog.size()));
    for (const auto& a : prog) {
      mix(static_cast<int64_t>(a.type));
      mix(a.micro_batch);
      mix(a.stage);
      mix(a.peer);
    }
  }
  return h;
}

std::string describe(const Action& a) {
  std::ostringstream out;
  out << planner::to_string(a.type) << "(mb " << a.micro_batch << ", stage " << a.stage << ")";
  return out.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------
// AutogradStageWork

AutogradStageWork::AutogradStageWork(int64_t num_stages, int64_t micro_batches, ForwardFn forward_fn,
                                     LossFn loss_fn, double loss_scale, ParametersFn stage_parameters,
                                     BackwardHook before_backward)
    : num_stages_(num_stages),
      micro_batches_(micro_batches),
      forward_fn_(std::move(forward_fn)),
      loss_fn_(std::move(loss_fn)),
      loss_scale_(loss_scale),
      stage_parameters_(std::move(stage_parameters)),
      before_backward_(std::move(before_backward)) {
  TORCH_CHECK(forward_fn_, "monarch: AutogradStageWork needs a forward function");
}

std::vector<at::Tensor> AutogradStageWork::forward(int64_t stage, int64_t mb, std::vector<at::Tensor> inputs) {
  auto outputs = forward_fn_(stage, mb, inputs);
  const bool last = stage == num_stages_ - 1;
  if (last && loss_fn_) {
    auto loss = loss_fn_(mb, outputs);
    TORCH_CHECK(loss.defined() && loss.numel() == 1, "monarch: the loss function must return a scalar, got ",
                loss.defined() ? loss.sizes() : at::IntArrayRef{});
    losses_[mb] = loss.detach().item<double>();
    outputs = {loss};
  }
  if (!at::GradMode::is_enabled()) return outputs;
  Stash s;
  for (auto& t : inputs) s.inputs.push_back(t);
  if (last && loss_fn_) {
    s.outputs = {outputs[0] * loss_scale_};
    outputs = {outputs[0].detach()};
  } else {
    s.outputs = outputs;
  }
  stash_[{stage, mb}] = std::move(s);
  return outputs;
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> AutogradStageWork::roots(
    Stash& s, const std::vector<at::Tensor>& grads) const {
  std::vector<at::Tensor> outs, gs;
  for (size_t i = 0; i < s.outputs.size(); ++i) {
    const auto& o = s.outputs[i];
    if (!o.defined() || !o.requires_grad()) continue;
    if (grads.empty()) {  // last stage: the loss
      outs.push_back(o);
      gs.push_back(at::Tensor());
    } else if (i < grads.size() && grads[i].defined()) {
      outs.push_back(o);
      gs.push_back(grads[i]);
    }
  }
  return {outs, gs};
}

std::vector<at::Tensor> AutogradStageWork::input_grads(const Stash& s) const {
  std::vector<at::Tensor> out;
  for (const auto& t : s.inputs) {
    if (t.defined() && t.requires_grad()) {
      out.push_back(t.grad().defined() ? t.grad() : at::zeros_like(t));
    } else {
      out.push_back(at::Tensor());
    }
  }
  return out;
}

void AutogradStageWork::note_backward(int64_t stage, int64_t mb) {
  const int64_t done = ++backwards_done_[stage];
  if (before_backward_) before_backward_(stage, mb, done == micro_batches_);
}

std::vector<at::Tensor> AutogradStageWork::backward(int64_t stage, int64_t mb, std::vector<at::Tensor> grads) {
  auto it = stash_.find({stage, mb});
  TORCH_CHECK(it != stash_.end(), "monarch: backward of micro-batch ", mb, " on stage ", stage,
              " without its forward");
  note_backward(stage, mb);
  auto [outs, gs] = roots(it->second, grads);
  if (!outs.empty()) torch::autograd::backward(outs, gs);
  auto result = input_grads(it->second);
  stash_.erase(it);
  return result;
}

std::vector<at::Tensor> AutogradStageWork::backward_input(int64_t stage, int64_t mb, std::vector<at::Tensor> grads) {
  auto it = stash_.find({stage, mb});
  TORCH_CHECK(it != stash_.end(), "monarch: backward_input of micro-batch ", mb, " on stage ", stage,
              " without its forward");
  Stash& s = it->second;
  std::vector<at::Tensor> wanted;
  std::vector<size_t> where;
  for (size_t i = 0; i < s.inputs.size(); ++i) {
    if (s.inputs[i].defined() && s.inputs[i].requires_grad()) {
      wanted.push_back(s.inputs[i]);
      where.push_back(i);
    }
  }
  const size_t num_inputs = wanted.size();
  if (stage_parameters_) {
    std::set<const void*> seen;  // a parameter listed twice is captured once
    for (auto& p : stage_parameters_(stage)) {
      if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) wanted.push_back(p);
    }
  }
  std::vector<at::Tensor> result(s.inputs.size());
  auto [outs, gs] = roots(s, grads);
  std::vector<at::Tensor> got(wanted.size());
  if (!wanted.empty() && !outs.empty()) {
    // One pass over the graph (then freed): input gradients, and the parameters' gradients
    // captured (not accumulated: the engines' hooks see every parameter once, in W); the
    // weight gradients of deferred linears are left for backward_weight (Qi et al. 2023).
    s.deferred = std::make_shared<WeightGradSink>();
    WeightGradSink::Collecting collecting(*s.deferred);
    ParkedTensorHooks parked({wanted.begin() + static_cast<std::ptrdiff_t>(num_inputs), wanted.end()});
    got = torch::autograd::grad(outs, wanted, gs, /*retain_graph=*/false, /*create_graph=*/false,
                                /*allow_unused=*/true);
  }
  for (size_t k = 0; k < num_inputs; ++k) {
    result[where[k]] = got[k].defined() ? got[k] : at::zeros_like(wanted[k]);
  }
  for (size_t k = num_inputs; k < wanted.size(); ++k) {
    if (got[k].defined()) s.parameter_grads.emplace_back(wanted[k], got[k]);
  }
  s.outputs.clear();  // the graph is gone; W needs only what B kept
  return result;
}

void AutogradStageWork::backward_weight(int64_t stage, int64_t mb) {
  auto it = stash_.find({stage, mb});
  TORCH_CHECK(it != stash_.end(), "monarch: backward_weight of micro-batch ", mb, " on stage ", stage,
              " without its forward");
  note_backward(stage, mb);
  Stash& s = it->second;
  // The deferred linears' weight gradients (dL/dyᵀ x: the GEMMs B skipped), added to what B
  // captured, then handed to autograd once with the parameters as roots: their gradient
  // accumulators (and the data-parallel / ZeRO hooks on them) run once, in one backward.
  std::vector<std::pair<at::Tensor, at::Tensor>> all = std::move(s.parameter_grads);
  if (s.deferred) {
    std::map<const void*, size_t> index;
    for (size_t i = 0; i < all.size(); ++i) index[all[i].first.unsafeGetTensorImpl()] = i;
    for (auto& [param, grad] : s.deferred->compute_weight_grads()) {
      auto found = index.find(param.unsafeGetTensorImpl());
      if (found != index.end()) {
        all[found->second].second = all[found->second].second + grad;
      } else {
        index[param.unsafeGetTensorImpl()] = all.size();
        all.emplace_back(param, grad);
      }
    }
  }
  if (!all.empty()) {
    std::vector<at::Tensor> roots_, grads_;
    for (auto& [param, grad] : all) {
      TORCH_CHECK(param.sizes() == grad.sizes(), "monarch: backward_weight of micro-batch ", mb, " on stage ", stage,
                  ": a parameter of shape ", param.sizes(), " got a gradient of shape ", grad.sizes(),
                  " (a parameter released between the two passes?)");
      roots_.push_back(param);
      grads_.push_back(grad);
    }
    torch::autograd::backward(roots_, grads_);
  }
  stash_.erase(it);
}

// ---------------------------------------------------------------------------------------
// PipelineExecutor

PipelineExecutor::PipelineExecutor(planner::Schedule schedule, Communicator& pp_group)
    : schedule_(std::move(schedule)), group_(pp_group), rank_(pp_group.group_rank()) {
  std::string problem;
  if (schedule_.ranks != group_.size()) {
    problem = "the schedule is for " + std::to_string(schedule_.ranks) + " pipeline ranks but the pp group has " +
              std::to_string(group_.size());
  } else if (static_cast<int64_t>(schedule_.per_rank.size()) != schedule_.ranks) {
    problem = "the schedule has " + std::to_string(schedule_.per_rank.size()) + " programs for " +
              std::to_string(schedule_.ranks) + " ranks";
  } else if (schedule_.num_stages() * schedule_.micro_batches * 2 * kSlots > INT_MAX) {
    problem = "too many (stage, micro-batch) pairs for message tags";
  } else {
    try {
      planner::check_schedule(schedule_);
    } catch (const planner::PlannerError& e) {
      problem = e.what();
    }
  }
  // Every rank learns whether every rank accepted the same schedule before any activation
  // moves: [fingerprint, ok] from each rank.
  auto mine = at::tensor({static_cast<int64_t>(fingerprint(schedule_)), int64_t{problem.empty()}}, at::kLong);
  auto all = at::empty({group_.size(), 2}, at::kLong);
  group_.all_gather(all, mine).wait();
  TORCH_CHECK(problem.empty(), "monarch: pipeline rank ", rank_, " refuses the schedule before running it: ",
              problem);
  for (int r = 0; r < group_.size(); ++r) {
    TORCH_CHECK(all[r][1].item<int64_t>() == 1, "monarch: pipeline rank ", r,
                " refused the schedule (see its error); nothing was run");
    TORCH_CHECK(all[r][0].item<int64_t>() == all[rank_][0].item<int64_t>(), "monarch: pipeline rank ", r,
                " holds a different schedule than rank ", rank_, "; every rank must run the same action lists");
  }
}

std::vector<int64_t> PipelineExecutor::local_stages() const {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < schedule_.num_stages(); ++s) {
    if (schedule_.rank_of_stage(s) == rank_) out.push_back(s);
  }
  return out;
}

int PipelineExecutor::tag(int64_t stage, int64_t mb, int direction, int slot) const {
  return static_cast<int>(((stage * schedule_.micro_batches + mb) * 2 + direction) * kSlots + slot);
}

void PipelineExecutor::send_tensors(const std::vector<at::Tensor>& tensors, int peer, int64_t stage, int64_t mb,
                                    int direction, bool with_meta) {
  TORCH_CHECK(tensors.size() <= static_cast<size_t>(kTensorSlots), "monarch: stage ", stage, " passes ",
              tensors.size(), " tensors to the next stage; at most ", kTensorSlots, " are supported");
  if (with_meta) {
    Meta m;
    std::vector<int64_t> words{static_cast<int64_t>(tensors.size())};
    for (const auto& t : tensors) {
      TORCH_CHECK(t.defined(), "monarch: stage ", stage, " returned an undefined tensor for the next stage");
      m.dtypes.push_back(t.scalar_type());
      m.shapes.push_back(t.sizes().vec());
      m.needs_grad.push_back(t.requires_grad() && at::isFloatingType(t.scalar_type()));
      words.push_back(static_cast<int64_t>(t.scalar_type()));
      words.push_back(m.needs_grad.back() ? 1 : 0);
      words.push_back(t.dim());
      for (auto d : t.sizes()) words.push_back(d);
    }
    TORCH_CHECK(static_cast<int64_t>(words.size()) <= kMetaLen, "monarch: stage ", stage,
                " activations have too many dimensions to describe");
    // The header's tags name the boundary, not the micro-batch: they match whichever
    // micro-batch each side happens to handle first. First one word: 0 when the activations
    // look as in the previous step (the receiver keeps that description), else the length
    // of the description that follows.
    auto& last = sent_header_[stage];
    const bool same = last == words;
    auto head = at::tensor(std::vector<int64_t>{same ? 0 : static_cast<int64_t>(words.size())}, at::kLong);
    pending_sends_.emplace_back(group_.send(head, peer, tag(stage, 0, direction, kMetaSlot)), head);
    if (!same) {
      auto body = at::tensor(words, at::kLong);
      pending_sends_.emplace_back(group_.send(body, peer, tag(stage, 1, direction, kMetaSlot)), body);
      last = words;
    }
    meta_[stage] = std::move(m);
  } else if (direction == 0) {
    const Meta& m = meta_.at(stage);
    for (size_t i = 0; i < tensors.size(); ++i) {
      TORCH_CHECK(i < m.shapes.size() && tensors[i].sizes().vec() == m.shapes[i] &&
                      tensors[i].scalar_type() == m.dtypes[i],
                  "monarch: stage ", stage, " micro-batch ", mb, " output ", i, " has shape ", tensors[i].sizes(),
                  " but the first micro-batch's was ", (i < m.shapes.size() ? at::IntArrayRef(m.shapes[i]) : at::IntArrayRef{}),
                  "; all micro-batches of a step must have the same shape");
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) continue;
    auto buf = tensors[i].detach().contiguous();
    pending_sends_.emplace_back(group_.send(buf, peer, tag(stage, mb, direction, static_cast<int>(i))), buf);
  }
}

std::vector<at::Tensor> PipelineExecutor::recv_tensors(int peer, int64_t stage, int64_t mb, int direction,
                                                       bool with_meta, double& wait_s) {
  auto start = Clock::now();
  if (with_meta) {
    auto head = at::empty({1}, at::kLong);
    group_.recv(head, peer, tag(stage, 0, direction, kMetaSlot)).wait();
    const int64_t len = head.item<int64_t>();
    TORCH_CHECK(len >= 0 && len <= kMetaLen, "monarch: corrupt activation header from pipeline rank ", peer);
    TORCH_CHECK(len > 0 || meta_.count(stage), "monarch: pipeline rank ", peer, " sent stage ", stage,
                "'s activations as unchanged, but this rank has no earlier description of them");
    if (len > 0) {
      auto buf = at::empty({len}, at::kLong);
      group_.recv(buf, peer, tag(stage, 1, direction, kMetaSlot)).wait();
      auto w = buf.data_ptr<int64_t>();
      Meta m;
      int64_t k = 0;
      const int64_t count = w[k++];
      TORCH_CHECK(count >= 0 && count <= kTensorSlots, "monarch: corrupt activation header from pipeline rank ", peer);
      for (int64_t i = 0; i < count; ++i) {
        TORCH_CHECK(k + 3 <= len, "monarch: corrupt activation header from pipeline rank ", peer);
        m.dtypes.push_back(static_cast<at::ScalarType>(w[k++]));
        m.needs_grad.push_back(w[k++] != 0);
        const int64_t ndim = w[k++];
        TORCH_CHECK(ndim >= 0 && k + ndim <= len, "monarch: corrupt activation header from pipeline rank ", peer);
        m.shapes.emplace_back(w + k, w + k + ndim);
        k += ndim;
      }
      meta_[stage] = std::move(m);
    }
  }
  const Meta& m = meta_.at(stage);
  std::vector<at::Tensor> out(m.shapes.size());
  std::vector<Handle> handles;
  for (size_t i = 0; i < m.shapes.size(); ++i) {
    if (direction == 1 && !m.needs_grad[i]) continue;  // no gradient flows back for it
    out[i] = at::empty(m.shapes[i], at::TensorOptions().dtype(m.dtypes[i]));
    handles.push_back(group_.recv(out[i], peer, tag(stage, mb, direction, static_cast<int>(i))));
  }
  for (auto& h : handles) h.wait();
  if (direction == 0) {
    for (size_t i = 0; i < out.size(); ++i) out[i].requires_grad_(m.needs_grad[i] && at::GradMode::is_enabled());
  }
  wait_s += seconds_since(start);
  return out;
}

PipelineStepStats PipelineExecutor::run(StageWork& work, bool forward_only) {
  PipelineStepStats stats;
  auto step_start = Clock::now();
  if (!last_step_complete_) {  // a step that failed part-way: describe everything afresh
    meta_.clear();
    sent_header_.clear();
  }
  last_step_complete_ = false;
  // A step that failed part-way leaves sends behind; Gloo's work objects own their buffers,
  // and waiting on them could block on a peer that gave up too.
  pending_sends_.clear();
  std::map<int64_t, bool> meta_done[2];  // per boundary stage: header already sent/received
  std::map<std::pair<int64_t, int64_t>, std::vector<at::Tensor>> inbox, outbox, grad_in, grad_out;
  // A boundary between two stages of this rank (ZB-V's turn): the schedule still sends and
  // receives (to itself), and the tensors change hands here without a message. The
  // activations are detached as a received copy would be (the next stage's graph starts at
  // them); they share the sender's storage, so an in-place change by the next stage is
  // autograd's "modified by an inplace operation" error, as it would be within one module.
  std::map<std::pair<int64_t, int64_t>, std::vector<at::Tensor>> turned_activations, turned_gradients;
  std::unique_ptr<at::NoGradGuard> no_grad;
  if (forward_only) no_grad = std::make_unique<at::NoGradGuard>();

  const int64_t step = step_++;
  const int64_t step_start_ns = trace::now_ns();
  auto traced = [&](const Action& a, int64_t start_ns) {
    trace::Event e;
    e.name = planner::action_name(a.type);
    e.category = "pipeline";
    e.start_ns = start_ns;
    e.end_ns = trace::now_ns();
    e.step = step;
    e.micro_batch = a.micro_batch;
    e.stage = a.stage;
    trace::record(std::move(e));
  };
  auto timed = [&](const Action& a, auto&& fn) {
    auto t = Clock::now();
    const int64_t start_ns = trace::now_ns();
    fn();
    traced(a, start_ns);
    stats.compute_s += seconds_since(t);
    stats.trace.push_back(a);
  };

  // What an earlier action of this program left for `a`; a missing entry means the list
  // runs an action before the one that produces its input.
  auto take = [&](std::map<std::pair<int64_t, int64_t>, std::vector<at::Tensor>>& box, const Action& a,
                  const char* what) {
    auto it = box.find({a.stage, a.micro_batch});
    TORCH_CHECK(it != box.end(), "monarch: pipeline rank ", rank_, ": ", describe(a), " finds no ", what,
                " (the action list runs it before the action producing it)");
    auto out = std::move(it->second);
    box.erase(it);
    return out;
  };

  for (const Action& a : program()) {
    const auto key = std::make_pair<int64_t, int64_t>(a.stage, a.micro_batch);
    try {
      switch (a.type) {
        case ActionType::recv_activation: {
          if (a.peer == rank_) {
            inbox[key] = take(turned_activations, a, "activations handed over by the previous stage");
            break;
          }
          const int64_t from = a.stage - 1;
          const bool first = !meta_done[0][from];
          meta_done[0][from] = true;
          const int64_t start_ns = trace::now_ns();
          inbox[key] = recv_tensors(a.peer, from, a.micro_batch, 0, first, stats.wait_s);
          traced(a, start_ns);
          break;
        }
        case ActionType::forward:
          timed(a, [&] {
            std::vector<at::Tensor> in;
            if (a.stage > 0) in = take(inbox, a, "received activations");
            outbox[key] = work.forward(a.stage, a.micro_batch, std::move(in));
          });
          break;
        case ActionType::send_activation: {
          if (a.peer == rank_) {
            std::vector<at::Tensor> handed;
            for (auto& t : take(outbox, a, "forward output")) {
              TORCH_CHECK(t.defined(), "monarch: stage ", a.stage, " returned an undefined tensor for the next stage");
              const bool needs_grad = t.requires_grad() && at::isFloatingType(t.scalar_type()) && at::GradMode::is_enabled();
              handed.push_back(t.detach().requires_grad_(needs_grad));
            }
            turned_activations[{a.stage + 1, a.micro_batch}] = std::move(handed);
            break;
          }
          const bool first = !meta_done[0][a.stage];
          meta_done[0][a.stage] = true;
          send_tensors(take(outbox, a, "forward output"), a.peer, a.stage, a.micro_batch, 0, first);
          break;
        }
        case ActionType::recv_gradient: {
          if (forward_only) break;
          if (a.peer == rank_) {
            grad_in[key] = take(turned_gradients, a, "gradients handed back by the next stage");
            break;
          }
          const int64_t start_ns = trace::now_ns();
          grad_in[key] = recv_tensors(a.peer, a.stage, a.micro_batch, 1, false, stats.wait_s);
          traced(a, start_ns);
          break;
        }
        case ActionType::backward:
        case ActionType::backward_input:
          if (forward_only) break;
          timed(a, [&] {
            std::vector<at::Tensor> g;
            if (a.stage < schedule_.num_stages() - 1) g = take(grad_in, a, "received gradients");
            grad_out[key] = a.type == ActionType::backward ? work.backward(a.stage, a.micro_batch, std::move(g))
                                                           : work.backward_input(a.stage, a.micro_batch, std::move(g));
          });
          break;
        case ActionType::backward_weight:
          if (forward_only) break;
          timed(a, [&] { work.backward_weight(a.stage, a.micro_batch); });
          break;
        case ActionType::send_gradient:
          if (forward_only) break;
          if (a.peer == rank_) {
            turned_gradients[{a.stage - 1, a.micro_batch}] = take(grad_out, a, "input gradients");
            break;
          }
          send_tensors(take(grad_out, a, "input gradients"), a.peer, a.stage - 1, a.micro_batch, 1, false);
          break;
      }
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "monarch: pipeline rank ", rank_, " failed at ", describe(a), ": ",
                  e.what_without_backtrace());
    }
  }
  auto t = Clock::now();
  for (auto& [h, buf] : pending_sends_) h.wait();
  pending_sends_.clear();
  stats.wait_s += seconds_since(t);
  stats.total_s = seconds_since(step_start);
  last_step_complete_ = true;
  log::debug("pipeline", "step ", step, " on pipeline rank ", rank_, ": ", log::fixed(stats.total_s, 4), " s, ",
             log::fixed(stats.compute_s, 4), " s computing, ", log::fixed(stats.wait_s, 4), " s waiting");
  trace::Event e;
  // A forward-only run (inference) is not a training step: the report's measured step is a
  // training one.
  e.name = forward_only ? "inference_step" : "step";
  e.category = "pipeline";
  e.start_ns = step_start_ns;
  e.end_ns = trace::now_ns();
  e.step = step;
  trace::record(std::move(e));
  return stats;
}

double PipelineExecutor::train_step(AutogradStageWork& work, PipelineStepStats* stats) {
  PipelineStepStats s = run(work);
  if (stats != nullptr) *stats = std::move(s);
  const int64_t loss_rank = schedule_.rank_of_stage(schedule_.num_stages() - 1);  // ZB-V: rank 0
  const bool last_here = rank_ == loss_rank;
  double sum = 0;
  for (const auto& [mb, loss] : work.losses()) sum += loss;
  auto value = at::tensor({last_here ? sum / static_cast<double>(schedule_.micro_batches) : 0.0}, at::kDouble);
  group_.broadcast(value, static_cast<int>(loss_rank)).wait();
  return value.item<double>();
}

}  // namespace monarch
