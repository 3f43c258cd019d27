"""Checkpoints of expert-parallel models reshard the experts (torch_monarch.checkpoint with
torch_monarch.experts): saved with ep=2 x dp=2 (DataParallel replicas over edp, or
parallelize's ZeRO-3 over edp), loaded into ep=4, into the other kind of ep=2, into the same
layout and into one process (the whole [experts, ...] tensors); a one-process checkpoint loaded
into ep=2. Parameters and AdamW state (exp_avg, exp_avg_sq rows follow their experts) are
compared exactly with the saved model's full state; the resumed steps' losses equal the
uninterrupted run's: bitwise in the same layout, within 1e-5 relative across layouts (the
layouts sum in other orders: test_experts.py's tolerance against one process).

One 4-rank launch (checkpoint_experts_workers.py) runs every case."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from torch_monarch import checkpoint
from dist_harness import launch
from moe_model import AUX, EXPERTS, VOCAB, aux_loss, batch, make_model
from checkpoint_experts_workers import K, RESUMES, SOURCES, make_optimizer

LOSS_REL = 1e-5
EP = {"dp_ep2": 2, "dp_ep4": 4, "zero3_ep2": 2, "zero3_ep4": 4}


def _plain():
    model = make_model()
    return model, make_optimizer(model.parameters())


def _plain_train(model, opt, first, count):
    losses = []
    for s in range(first, first + count):
        inputs, targets = batch(s)
        opt.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + AUX * aux_loss(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _plain_state(model, opt):
    """{(name, "param" or an AdamW key): tensor} of a one-process model."""
    out = {}
    for name, p in model.named_parameters():
        out[(name, "param")] = p.detach().clone()
        for k, v in opt.state.get(p, {}).items():
            out[(name, k)] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def _assemble(dumps, shapes):
    """The full state from every rank's dump (checkpoint_experts_workers.dump), by the engines'
    rules: experts at rows [first, first + E/ep), ZeRO's rows [i c, (i+1) c) of the ep-local
    tensor. Replicas must agree; every element must be held by some rank."""
    full, held = {}, {}
    for rank, dump in enumerate(dumps):
        for name, e in dump.items():
            for kind, local in [("param", e["param"])] + list(e["state"].items()):
                key = (name, kind)
                if local.dim() == 0:  # Adam's step count: the same on every rank
                    if key in full:
                        assert torch.equal(full[key], local), f"rank {rank}: {key} differs between ranks"
                    full[key] = local
                    continue
                rows, start, count = e["rows"], 0, e["rows"]
                if e["zero"] is not None:
                    i, n = e["zero"]
                    chunk = math.ceil(rows / n)
                    start = min(i * chunk, rows)
                    count = max(0, min(rows - start, chunk))
                at = (e["first"] or 0) + start
                target = full.setdefault(key, torch.zeros(shapes[name], dtype=local.dtype))
                mask = held.setdefault(key, torch.zeros(shapes[name][0], dtype=torch.bool))
                block = local[:count]
                again = mask[at:at + count]
                if again.any():
                    assert again.all() and torch.equal(target[at:at + count], block), \
                        f"rank {rank}: replica of {key} rows {at}..{at + count} differs"
                target[at:at + count] = block
                mask[at:at + count] = True
    for key, mask in held.items():
        assert mask.all(), f"{key}: rows {(~mask).nonzero().flatten().tolist()} held by no rank"
    return full


def _assert_same_state(got, want, where):
    assert set(got) == set(want), f"{where}: keys {sorted(set(got) ^ set(want))[:6]} differ"
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{where}: {key} differs"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_experts")
    # The one-process checkpoint (ep=1, whole expert tensors), and its uninterrupted run.
    model, opt = _plain()
    before = _plain_train(model, opt, 0, K)
    checkpoint.save(model, opt, str(root / "plain"), step=K)
    plain_state = _plain_state(model, opt)
    plain_losses = before + _plain_train(model, opt, K, K)
    r = launch(4, str(root), timeout=240, worker="checkpoint_experts_workers.py")
    assert r.ok, r.describe()
    results = [torch.load(r.result_path(k)) for k in range(4)]
    shapes = {n: tuple(p.shape) for n, p in make_model().named_parameters()}
    saved = {"plain": (plain_state, plain_losses)}
    for source in SOURCES:
        saved[source] = (_assemble([res["sources"][source]["dump"] for res in results], shapes),
                         results[0]["sources"][source]["losses"])
    return root, results, shapes, saved


def test_the_saved_state_as_assembled_is_the_engines_whole_model(run):
    """The assembly rule the checks rely on gives what parallelize's own state_dict() gathers."""
    _, results, _, saved = run
    full, _ = saved["zero3_ep2"]
    for rank, res in enumerate(results):
        engine = res["sources"]["zero3_ep2"]["full"]
        assert set(engine) == {n for n, k in full if k == "param"}
        for name, value in engine.items():
            assert torch.equal(value, full[(name, "param")]), f"rank {rank}: {name}"


@pytest.mark.parametrize("source", SOURCES)
def test_each_expert_slice_is_written_once(run, source):
    """Experts replicated over edp (or ZeRO rows of them) are written once: an expert tensor
    has one slice per ep rank (DataParallel) or per ep x edp ZeRO shard, disjoint, covering it."""
    root = run[0]
    with open(root / source / "index.json") as f:
        index = json.load(f)
    expert_names = [n for n in index["tensors"] if ".experts." in n and n.endswith(("gate_up_proj", "down_proj"))]
    assert expert_names
    for name in expert_names + [f"optimizer.{n}.exp_avg" for n in expert_names]:
        meta = index["tensors"][name]
        assert meta["shape"][0] == EXPERTS, f"{source}: {name} is stored as {meta['shape']}"
        slices = sorted((s["offsets"][0], s["lengths"][0]) for s in meta["slices"])
        assert len(slices) == (2 if source.startswith("dp") else 4), f"{source}: {name}: {slices}"
        at = 0
        for offset, length in slices:
            assert offset == at, f"{source}: {name}: {slices}"
            at += length
        assert at == EXPERTS


@pytest.mark.parametrize("case", [f"{s}->{t}" for s, t in RESUMES])
def test_a_checkpoint_loads_into_another_ep_and_training_goes_on(run, case):
    _, results, shapes, saved = run
    source, target = case.split("->")
    want, uninterrupted = saved[source]
    got = _assemble([res["resumes"][case]["dump"] for res in results], shapes)
    # Every rank's experts' rows (of the parameters and of Adam's moments), and the rest.
    _assert_same_state(got, want, case)
    for rank, res in enumerate(results):
        resumed = res["resumes"][case]
        assert resumed["step"] == K
        if resumed["full"] is not None:  # parallelize: the engine's whole model, gathered over ep
            for name, value in resumed["full"].items():
                assert torch.equal(value, want[(name, "param")]), f"{case} rank {rank}: state_dict()[{name!r}]"
        if source == target:
            assert resumed["losses"] == uninterrupted[K:], f"{case} rank {rank}"
        else:
            assert resumed["losses"] == pytest.approx(uninterrupted[K:], rel=LOSS_REL), f"{case} rank {rank}"


@pytest.mark.parametrize("source", SOURCES)
def test_an_ep2_checkpoint_loads_into_one_process(run, source):
    root, _, _, saved = run
    want, uninterrupted = saved[source]
    model, opt = _plain()
    assert checkpoint.load(model, opt, str(root / source))["step"] == K
    _assert_same_state(_plain_state(model, opt), want, f"{source}->plain")
    assert _plain_train(model, opt, K, K) == pytest.approx(uninterrupted[K:], rel=LOSS_REL)


def test_split_experts_without_a_mesh_are_refused_on_every_rank(run):
    root, results, _, _ = run
    for res in results:
        assert res["refused"] is not None and "spread over the ranks but the model has no mesh" in res["refused"]
    assert not os.path.exists(root / "refused")
