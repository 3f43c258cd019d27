"""Measured profiles (torch_monarch.profile) and planning from them."""

import json
import os

import pytest
import torch
from torch import nn

import torch_monarch
from torch_monarch import planner, profile
from torch_monarch.api import model_graph
from dist_harness import launch_with_launcher
from tiny_gpt import batch, loss_fn, make_model


class Wide(nn.Module):
    """Four linear layers, the third 8x the work of the others: what a profile must see."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64), nn.Sequential(
            nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64)), nn.Linear(64, 64)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_each_layer_is_timed_and_the_heavy_one_measures_heavier():
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(256, 64)
    layers = [f"blocks.{i}" for i in range(4)]
    prof = profile.measure(model, lambda b: (x[: 64 * b], None), layers=layers, micro_batches=(1, 4), repeats=5)
    assert [l.name for l in prof.layers] == layers
    for l in prof.layers:
        assert [p.micro_batch for p in l.points] == [1, 4]
        assert all(p.forward_s > 0 and p.backward_s > 0 for p in l.points)
    # The repeats' spread, what the search takes as the profile's resolution: measured, and small.
    assert 0 < prof.repeatability < 0.5
    heavy = prof.layers[2].points[1]
    light = prof.layers[1].points[1]
    assert heavy.forward_s > 2 * light.forward_s
    assert heavy.backward_s > 2 * light.backward_s
    # Four times the samples take longer than one (the heavy layer is well above timer noise).
    assert prof.layers[2].points[1].forward_s > 1.5 * prof.layers[2].points[0].forward_s
    assert model.blocks[0].weight.grad is None  # the measurement leaves no gradients behind


def test_a_profile_round_trips_and_plans():
    model = make_model()
    x, y = batch(0, 4)
    info, graph = model_graph(model, x[:1])
    prof = profile.measure(model, lambda b: (x[:b], y[:b]), layers=info.layer_modules, loss_fn=loss_fn,
                           micro_batches=(1, 2), repeats=2, source="test")
    # Blocks run attention and an MLP: each outweighs the position embedding's lookup.
    times = {l.name: l.points[-1].forward_s + l.points[-1].backward_s for l in prof.layers}
    assert times["blocks.0"] > times["wpe"]
    back = planner._P.profile_from_json(planner._P.profile_to_json(prof))
    assert planner._P.profile_to_json(back) == planner._P.profile_to_json(prof)
    assert back.repeatability == pytest.approx(prof.repeatability)
    p = torch_monarch.plan(model, x[:1], 8, planner.cluster("cpu", 2), profile=prof)
    assert p.prediction.estimator == "profile: test"
    assert "layer times from the profile: test" in p.report()
    analytic = torch_monarch.plan(model, x[:1], 8, planner.cluster("cpu", 2))
    assert analytic.prediction.estimator == "analytic"


def test_bad_profiles_and_names_are_refused(tmp_path):
    model = make_model()
    x, y = batch(0, 2)
    with pytest.raises(ValueError, match="no module 'decoder.0'"):
        profile.measure(model, lambda b: (x[:b], y[:b]), layers=["decoder.0"])
    with pytest.raises(ValueError, match="micro_batches must be sizes >= 1"):
        profile.measure(model, lambda b: (x[:b], y[:b]), layers=["wte"], micro_batches=(0,))
    info, graph = model_graph(model, x[:1])
    wrong = planner.MeasuredProfile(source="other", layers=[planner.LayerProfile(
        name="decoder.0", points=[planner.ProfilePoint(micro_batch=1, forward_s=1.0, backward_s=2.0)])])
    with pytest.raises(planner.ValidationError, match="no measurement for layer 'wte'"):
        planner.plan(graph, planner.cluster("cpu", 2), 8, profile=wrong)
    path = tmp_path / "p.json"
    path.write_text('{"format": "monarch-profile", "version": 2, "source": "x", "layers": []}')
    with pytest.raises(planner.FormatError, match="version 2 is not supported"):
        planner.load_profile(path)
    with pytest.raises(FileNotFoundError):
        planner.load_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="profile= is what the planner plans from"):
        torch_monarch.parallelize(model, plan=planner.plan(graph, planner.cluster("cpu", 1), 2), profile=wrong)


def test_every_rank_measures_at_once_and_parallelize_plans_from_the_profile():
    run = launch_with_launcher(2, "profile", worker="profile_workers.py", timeout=240)
    assert run.ok, run.describe()
    results = []
    for r in range(2):
        with open(os.path.join(run.out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    assert results[0]["profile"] == results[1]["profile"]  # one profile: the ranks' mean
    assert json.loads(results[0]["profile"])["source"] == "profile_workers"
    assert results[0]["estimator"] == results[1]["estimator"] == "profile: profile_workers"
    assert results[0]["plan"] == results[1]["plan"]
    assert results[0]["loss"] > 0
