"""Measured profiles: per-layer forward and backward times of a model on this machine, for
the planner's profile estimator (``planner.plan(..., profile=...)``, docs/cost_model.md).

    from torch_monarch import profile
    prof = profile.measure(model, lambda b: (tokens[:b], targets[:b]), loss_fn=loss,
                           layers=info.layer_modules, micro_batches=(1, 2, 4))
    planner.save_profile(prof, "profile.json")
    plan = torch_monarch.plan(model, x, global_batch=64, profile="profile.json")

How a layer is timed, on the real model with hooks (no copy, no change to its code):
  * forward: from the end of the previous layer's forward to the end of this one's (code
    between layers counts towards the next layer; the loss towards the last);
  * backward: from the moment the gradient of this layer's output is ready to the moment
    the gradient of the previous layer's output is (the first layer's ends when backward()
    returns; the last layer's starts when backward() is called, so it includes the loss's).
So the layers' times add up to the measured forward + backward of the whole model. Layers
whose module is not a leaf of the layer list (parameters held by a container) get 0: their
work is counted in their neighbours'.

Called on every rank of a job (``world=``), all ranks measure at once, as they will train:
the times are what a rank gets while the others compute too, the meaning the planner gives
to a cluster's rates when ranks share cores. The result is the same on every rank (the mean
over ranks of each layer's median time), and the job's links can be added from a probed
cluster (``links_from``).
"""

import statistics
import time

import torch
from torch import nn

from . import planner as _planner


class _Clock:
    def __init__(self, model, layers):
        # On a GPU a hook runs when the kernel is queued, not when it ends: wait for the device
        # at every mark (what the measured times then include, the planner's rates do too).
        on_gpu = any(p.is_cuda for p in model.parameters())
        self.sync = torch.cuda.synchronize if on_gpu else (lambda: None)
        self.modules = {}
        self.timed = []
        for name in layers:
            inner = [o for o in layers if o != name and (name == "" or o.startswith(name + "."))]
            if inner:
                continue  # a container: its own parameters' time is in its neighbours'
            self.modules[name] = model.get_submodule(name)
            self.timed.append(name)
        self.forward_end = {}
        self.grad_ready = {}
        self.handles = []
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_hook(self._post(name)))

    def _post(self, name):
        def hook(_module, _inputs, output):
            if name in self.forward_end:
                return  # called again (a shared module): the first call marks the layer
            self.sync()
            self.forward_end[name] = time.perf_counter()
            t = _first_grad_tensor(output)
            if t is not None:
                def on_grad(grad, name=name):
                    if name not in self.grad_ready:
                        self.sync()
                        self.grad_ready[name] = time.perf_counter()
                    return grad
                t.register_hook(on_grad)
        return hook

    def reset(self):
        self.forward_end.clear()
        self.grad_ready.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def _first_grad_tensor(x):
    if isinstance(x, torch.Tensor):
        return x if x.requires_grad else None
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_grad_tensor(v)
            if t is not None:
                return t
    return None


def _one_step(model, clock, inputs, target, loss_fn):
    """Per-layer (forward_s, backward_s) of one forward + backward."""
    clock.reset()
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (
        (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {})
    clock.sync()
    t0 = time.perf_counter()
    out = model(*args, **kwargs)
    loss = loss_fn(out, target)
    clock.sync()
    t_loss = time.perf_counter()
    t_back = time.perf_counter()
    loss.backward()
    clock.sync()
    t_end = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    ran = sorted((t, n) for n, t in clock.forward_end.items())
    forward = {n: 0.0 for n in clock.timed}
    previous = t0
    for i, (t, n) in enumerate(ran):
        end = t_loss if i + 1 == len(ran) else t
        forward[n] = end - previous
        previous = end
    backward = {n: 0.0 for n in clock.timed}
    with_grad = [n for _, n in ran if n in clock.grad_ready]
    for i, n in enumerate(with_grad):
        start = t_back if i + 1 == len(with_grad) else clock.grad_ready[n]
        end = t_end if i == 0 else clock.grad_ready[with_grad[i - 1]]
        backward[n] = max(0.0, end - start)
    return forward, backward


def measure(model: nn.Module, batch, *, layers, loss_fn=None, micro_batches=(1, 2, 4), repeats=3, world=None,
            links_from=None, source=None):
    """MeasuredProfile of ``model``: for each micro-batch size ``b`` in ``micro_batches``,
    ``batch(b)`` gives ``(inputs, target)`` (inputs: a tensor, a tuple of positional inputs or
    a dict of keyword inputs), ``loss_fn(output, target)`` the scalar to differentiate
    (default: the mean of the output). One warm-up step, then the median of ``repeats``.
    ``layers``: the planner graph's layer names in order (``ModelInfo.layer_modules``, or
    ``[l.name for l in graph.layers]``). ``world``: measure on every rank at once and agree
    on the mean. ``links_from``: a probed Cluster whose link latency / bandwidth go in."""
    if loss_fn is None:
        loss_fn = lambda out, _target: _first_grad_tensor(out).float().mean()  # noqa: E731
    layers = list(layers)
    missing = [n for n in layers if n != "" and not _has_submodule(model, n)]
    if missing:
        raise ValueError(f"profile.measure: the model has no module {missing[0]!r} "
                         f"({len(missing)} layer name(s) not found; pass the graph of this model)")
    sizes = sorted(set(int(b) for b in micro_batches))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"profile.measure: micro_batches must be sizes >= 1, got {list(micro_batches)}")
    if repeats < 1:
        raise ValueError(f"profile.measure: repeats must be >= 1, got {repeats}")
    group = None
    if world is not None and world.size > 1:
        from . import _runtime
        group = _runtime.DeviceMesh(world, pp=1, dp=world.size, tp=1).group("dp")
    was_training = model.training
    model.train()
    clock = _Clock(model, layers)
    results = {n: [] for n in layers}
    spreads = []  # per size: (slowest - fastest) / median of the repeats' whole-model times
    try:
        for b in sizes:
            inputs, target = batch(b)
            _one_step(model, clock, inputs, target, loss_fn)  # warm-up
            fwd = {n: [] for n in clock.timed}
            bwd = {n: [] for n in clock.timed}
            for _ in range(repeats):
                if group is not None:
                    group.barrier()  # every rank computes at once
                f, g = _one_step(model, clock, inputs, target, loss_fn)
                for n in clock.timed:
                    fwd[n].append(f[n])
                    bwd[n].append(g[n])
            med = [(statistics.median(fwd[n]), statistics.median(bwd[n])) if n in fwd else (0.0, 0.0)
                   for n in layers]
            # The whole model's forward + backward in each repeat (what a step prediction sums).
            totals = [sum(fwd[n][r] + bwd[n][r] for n in clock.timed) for r in range(repeats)]
            if repeats > 1 and statistics.median(totals) > 0:
                spreads.append((max(totals) - min(totals)) / statistics.median(totals))
            if group is not None:
                t = torch.tensor([v for pair in med for v in pair], dtype=torch.float64)
                group.all_reduce(t).wait()
                t /= world.size
                med = [(t[2 * i].item(), t[2 * i + 1].item()) for i in range(len(layers))]
            for n, (f, g) in zip(layers, med):
                results[n].append(_planner.ProfilePoint(micro_batch=b, forward_s=f, backward_s=g))
    finally:
        clock.remove()
        model.train(was_training)
    ranks = world.size if world is not None else 1
    # The profile's repeatability: the median over sizes of its repeats' spread, the mean over ranks
    # (the search treats predictions closer than this as equal: Estimator::resolution).
    repeatability = statistics.median(spreads) if spreads else 0.0
    if group is not None:
        t = torch.tensor([repeatability], dtype=torch.float64)
        group.all_reduce(t).wait()
        repeatability = t.item() / world.size
    prof = _planner.MeasuredProfile(
        source=source or f"{type(model).__name__} on this machine, {ranks} rank(s) measuring at once",
        layers=[_planner.LayerProfile(name=n, points=results[n]) for n in layers])
    prof.repeatability = min(repeatability, 0.49)
    if links_from is not None:
        prof.intra_node = _planner.LinkProfile(latency_s=links_from.intra_node_latency_s,
                                               bytes_per_s=links_from.intra_node_bytes_per_s)
        if links_from.nodes > 1:
            prof.inter_node = _planner.LinkProfile(latency_s=links_from.inter_node_latency_s,
                                                   bytes_per_s=links_from.inter_node_bytes_per_s)
    _planner._P.validate_profile(prof)
    return prof


def _has_submodule(model, name):
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False
