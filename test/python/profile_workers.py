"""Worker for test_profile.py: every rank measures the profile at once, then parallelize plans
from it (rank 0) and trains one step. Writes rank<r>.json with the profile's JSON and the plan."""

import json
import os
import sys

import torch

import torch_monarch
from torch_monarch import planner, profile
from tiny_gpt import batch, loss_fn, make_model
from torch_monarch.api import model_graph


def main():
    torch.set_num_threads(1)
    world = torch_monarch.init(timeout=120)
    model = make_model()
    x, y = batch(0, 8)
    info, _ = model_graph(model, x[:1])
    prof = profile.measure(model, lambda b: (x[:b], y[:b]), layers=info.layer_modules, loss_fn=loss_fn,
                           micro_batches=(1, 2), repeats=2, world=world, source="profile_workers")
    pm = torch_monarch.parallelize(make_model(), example_input=x[:1], global_batch=8, profile=prof)
    # The loss over split logits if the plan splits the head over tp (fast links make it so).
    loss = pm.train_step(*pm.local_batch(x, y),
                         lambda logits, t: torch_monarch.vocab_parallel_cross_entropy(logits, t, pm.mesh))
    out = os.environ["MONARCH_TEST_OUTPUT"]
    with open(os.path.join(out, f"rank{world.rank}.json"), "w") as f:
        json.dump({"profile": planner._P.profile_to_json(prof), "estimator": pm.plan.prediction.estimator,
                   "plan": pm.plan.summary(), "loss": float(loss)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
