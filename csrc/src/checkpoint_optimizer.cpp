// torch::optim state and options under Python's torch.optim keys (checkpoint_optimizer.h).
#include "checkpoint_optimizer.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <stdexcept>
#include <typeinfo>

namespace monarch::checkpoint_detail {
namespace {

using torch::optim::OptimizerParamState;

at::Tensor step_tensor(int64_t step) { return at::scalar_tensor(static_cast<double>(step), at::kFloat); }

int64_t step_value(const at::Tensor& t) { return static_cast<int64_t>(std::llround(t.item<double>())); }

void add(std::vector<StateValue>& out, const char* key, const at::Tensor& t) {
  if (t.defined()) out.push_back({key, t, true});
}

std::string type_name(const torch::optim::Optimizer& optimizer) { return c10::demangle(typeid(optimizer).name()); }

const at::Tensor& required(const std::map<std::string, at::Tensor>& values, const char* key, const std::string& name) {
  auto it = values.find(key);
  if (it == values.end()) {
    throw std::invalid_argument("optimizer state '" + std::string(key) + "' of '" + name + "' is not in the checkpoint");
  }
  return it->second;
}

at::Tensor optional(const std::map<std::string, at::Tensor>& values, const char* key) {
  auto it = values.find(key);
  return it == values.end() ? at::Tensor() : it->second;
}

void only_keys(const std::map<std::string, at::Tensor>& values, std::initializer_list<const char*> known,
               const std::string& name, const std::string& optimizer) {
  for (const auto& [key, value] : values) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (!ok) {
      throw std::invalid_argument("optimizer state '" + key + "' of '" + name + "' is not state of " + optimizer +
                                  " (saved by another optimizer?)");
    }
  }
}

// Adam and AdamW keep the same state under the same keys.
template <typename State>
std::vector<StateValue> adam_state(const State& s) {
  std::vector<StateValue> out{{"step", step_tensor(s.step()), false}};
  add(out, "exp_avg", s.exp_avg());
  add(out, "exp_avg_sq", s.exp_avg_sq());
  add(out, "max_exp_avg_sq", s.max_exp_avg_sq());
  return out;
}

template <typename State>
std::unique_ptr<OptimizerParamState> make_adam_state(const std::map<std::string, at::Tensor>& v, const std::string& name,
                                                     const std::string& type) {
  only_keys(v, {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, name, type);
  auto s = std::make_unique<State>();
  s->step(step_value(required(v, "step", name)));
  s->exp_avg(required(v, "exp_avg", name));
  s->exp_avg_sq(required(v, "exp_avg_sq", name));
  s->max_exp_avg_sq(optional(v, "max_exp_avg_sq"));
  return s;
}

template <typename Options>
nlohmann::json adam_options(const Options& o) {
  return {{"lr", o.lr()},
          {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()},
          {"amsgrad", o.amsgrad()}};
}

template <typename Options>
void set_adam_options(Options& o, const nlohmann::json& j) {
  if (j.contains("betas") && j["betas"].is_array() && j["betas"].size() == 2) {
    o.betas(std::make_tuple(j["betas"][0].get<double>(), j["betas"][1].get<double>()));
  }
  if (j.contains("eps")) o.eps(j["eps"].get<double>());
  if (j.contains("weight_decay")) o.weight_decay(j["weight_decay"].get<double>());
  if (j.contains("amsgrad")) o.amsgrad(j["amsgrad"].get<bool>());
}

}  // namespace

std::vector<StateValue> optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  auto& states = optimizer.state();
  auto it = states.find(p.unsafeGetTensorImpl());
  if (it == states.end() || !it->second) return {};
  OptimizerParamState* s = it->second.get();
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(s)) return adam_state(*a);
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(s)) return adam_state(*a);
  if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(s)) {
    std::vector<StateValue> out;
    add(out, "momentum_buffer", g->momentum_buffer());
    return out;
  }
  if (auto* g = dynamic_cast<torch::optim::AdagradParamState*>(s)) {
    std::vector<StateValue> out{{"step", step_tensor(g->step()), false}};
    add(out, "sum", g->sum());
    return out;
  }
  if (auto* r = dynamic_cast<torch::optim::RMSpropParamState*>(s)) {
    std::vector<StateValue> out{{"step", step_tensor(r->step()), false}};
    add(out, "square_avg", r->square_avg());
    add(out, "momentum_buffer", r->momentum_buffer());
    add(out, "grad_avg", r->grad_avg());
    return out;
  }
  throw std::invalid_argument("the state of " + type_name(optimizer) + " cannot be saved (Adam, AdamW, SGD, Adagrad and "
                              "RMSprop can)");
}

std::unique_ptr<OptimizerParamState> make_optimizer_state(torch::optim::Optimizer& optimizer,
                                                         const std::map<std::string, at::Tensor>& v,
                                                         const std::string& name) {
  std::unique_ptr<OptimizerParamState> state;
  const std::string type = type_name(optimizer);
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
    state = make_adam_state<torch::optim::AdamWParamState>(v, name, type);
  } else if (dynamic_cast<torch::optim::Adam*>(&optimizer)) {
    state = make_adam_state<torch::optim::AdamParamState>(v, name, type);
  } else if (dynamic_cast<torch::optim::SGD*>(&optimizer)) {
    only_keys(v, {"momentum_buffer"}, name, type);
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(optional(v, "momentum_buffer"));
    state = std::move(s);
  } else if (dynamic_cast<torch::optim::Adagrad*>(&optimizer)) {
    only_keys(v, {"step", "sum"}, name, type);
    auto s = std::make_unique<torch::optim::AdagradParamState>();
    s->step(step_value(required(v, "step", name)));
    s->sum(required(v, "sum", name));
    state = std::move(s);
  } else if (dynamic_cast<torch::optim::RMSprop*>(&optimizer)) {
    only_keys(v, {"step", "square_avg", "momentum_buffer", "grad_avg"}, name, type);
    auto s = std::make_unique<torch::optim::RMSpropParamState>();
    s->step(step_value(required(v, "step", name)));
    s->square_avg(required(v, "square_avg", name));
    s->momentum_buffer(optional(v, "momentum_buffer"));
    s->grad_avg(optional(v, "grad_avg"));
    state = std::move(s);
  } else {
    throw std::invalid_argument("the state of " + type + " cannot be loaded (Adam, AdamW, SGD, Adagrad and RMSprop can)");
  }
  return state;
}

nlohmann::json group_hyperparameters(const torch::optim::OptimizerOptions& options) {
  if (auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) return adam_options(*o);
  if (auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&options)) return adam_options(*o);
  if (auto* o = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    return {{"lr", o->lr()}, {"momentum", o->momentum()}, {"dampening", o->dampening()},
            {"weight_decay", o->weight_decay()}, {"nesterov", o->nesterov()}};
  }
  if (auto* o = dynamic_cast<const torch::optim::AdagradOptions*>(&options)) {
    return {{"lr", o->lr()}, {"lr_decay", o->lr_decay()}, {"weight_decay", o->weight_decay()},
            {"initial_accumulator_value", o->initial_accumulator_value()}, {"eps", o->eps()}};
  }
  if (auto* o = dynamic_cast<const torch::optim::RMSpropOptions*>(&options)) {
    return {{"lr", o->lr()}, {"alpha", o->alpha()}, {"eps", o->eps()}, {"weight_decay", o->weight_decay()},
            {"momentum", o->momentum()}, {"centered", o->centered()}};
  }
  return {{"lr", options.get_lr()}};
}

void set_group_hyperparameters(torch::optim::OptimizerOptions& options, const nlohmann::json& j) {
  if (j.contains("lr") && j["lr"].is_number()) options.set_lr(j["lr"].get<double>());
  if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) return set_adam_options(*o, j);
  if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) return set_adam_options(*o, j);
  if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
    if (j.contains("momentum")) o->momentum(j["momentum"].get<double>());
    if (j.contains("dampening")) o->dampening(j["dampening"].get<double>());
    if (j.contains("weight_decay")) o->weight_decay(j["weight_decay"].get<double>());
    if (j.contains("nesterov")) o->nesterov(j["nesterov"].get<bool>());
    return;
  }
  if (auto* o = dynamic_cast<torch::optim::AdagradOptions*>(&options)) {
    if (j.contains("lr_decay")) o->lr_decay(j["lr_decay"].get<double>());
    if (j.contains("weight_decay")) o->weight_decay(j["weight_decay"].get<double>());
    if (j.contains("eps")) o->eps(j["eps"].get<double>());
    return;
  }
  if (auto* o = dynamic_cast<torch::optim::RMSpropOptions*>(&options)) {
    if (j.contains("alpha")) o->alpha(j["alpha"].get<double>());
    if (j.contains("eps")) o->eps(j["eps"].get<double>());
    if (j.contains("weight_decay")) o->weight_decay(j["weight_decay"].get<double>());
    if (j.contains("momentum")) o->momentum(j["momentum"].get<double>());
    if (j.contains("centered")) o->centered(j["centered"].get<bool>());
  }
}

}  // namespace monarch::checkpoint_detail
