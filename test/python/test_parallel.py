"""Tensor, pipeline and hybrid parallelism: parity with one process, executed action lists,
the vocabulary-parallel loss, and refusals of bad layouts.

Parity setup (as the runtime tests): fp32, AdamW, 10 steps, dropout off, the tiny GPT with
its embedding tied to the output head. Tolerances:
  * each step's loss: 1e-5 relative;
  * step-0 gradients: every element within 1e-5 of the reference tensor's largest magnitude
    (the direct check that each rank's shard is the matching slice of the reference);
  * final parameters: 1e-5 relative in norm per tensor, and every element within 1e-4 of the
    tensor's largest magnitude. Elementwise the runs differ by more than the gradients do
    because Adam divides by sqrt(v): an element whose gradient is rounding noise (~1e-7)
    takes steps of ~lr whatever the noise, so a summation-order change (tp partial sums,
    micro-batch accumulation) moves it by a few 1e-5 of the tensor's scale.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from dist_harness import launch
from tiny_gpt import train_reference
from torch_monarch import _runtime
from torch_monarch.pipeline import split_model

LOSS_REL = 1e-5
GRAD_REL = 1e-5
PARAM_NORM_REL = 1e-5
PARAM_ELEMENT_REL = 1e-4

LAYOUTS = {
    "tp2": (2, "tp=2"),
    "tp4": (4, "tp=4"),
    "tp2_sp": (2, "tp=2,sp=1"),
    "tp4_sp": (4, "tp=4,sp=1"),
    "pp2_gpipe": (2, "pp=2,m=4,layers=4,schedule=gpipe"),
    "pp2_1f1b": (2, "pp=2,m=4,layers=4,schedule=1f1b"),
    "pp2_interleaved": (2, "pp=2,m=4,layers=4,schedule=interleaved_1f1b,v=2"),
    "pp2_zb_h1": (2, "pp=2,m=4,layers=4,schedule=zb_h1"),
    "pp4_gpipe": (4, "pp=4,m=4,layers=4,schedule=gpipe"),
    "pp4_1f1b": (4, "pp=4,m=4,layers=4,schedule=1f1b"),
    "pp4_interleaved": (4, "pp=4,m=4,layers=8,schedule=interleaved_1f1b,v=2"),
    "pp4_zb_h1": (4, "pp=4,m=4,layers=4,schedule=zb_h1"),
    # ZB-V: two stages per rank as a V; the tied embedding and head are both on rank 0.
    "pp2_zbv": (2, "pp=2,m=4,layers=4,schedule=zbv,v=2"),
    "pp4_zbv": (4, "pp=4,m=4,layers=8,schedule=zbv"),
    "pp2_zbv_fsdp2": (4, "pp=2,dp=2,zero=3,m=2,layers=4,schedule=zbv"),
    "dp2_tp2": (4, "dp=2,tp=2"),
    "dp2_tp2_sp_direct": (4, "dp=2,tp=2,sp=1,direct=1"),
    "tp2_replicas_start_different": (2, "tp=2,sp=1,perturb=1"),
    "pp2_tied_copies_start_different": (2, "pp=2,m=4,layers=4,perturb=1"),
    "pp2_fsdp2": (4, "pp=2,dp=2,zero=3,m=2,layers=4"),
    "pp2_tp2": (4, "pp=2,tp=2,m=4,layers=4"),
    "pp2_dp2_tp2": (8, "pp=2,dp=2,tp=2,m=2,layers=4,schedule=1f1b"),
}

COMPUTE = {"forward", "backward", "backward_input", "backward_weight"}


@functools.lru_cache(maxsize=None)
def reference(layers):
    losses, state, grads = train_reference(with_grads=True, layers=layers)
    assert losses[-1] < losses[0] - 0.1, f"reference does not train: {losses}"
    return losses, state, grads


def layers_of(layout):
    for item in layout.split(","):
        if item.startswith("layers="):
            return int(item.split("=")[1])
    return 2


def expected_slice(ref, spec, result, name):
    if spec is None:
        return ref
    dim, parts = spec
    return _runtime.shard_tensor(ref, dim, result["tp_rank"], result["tp"], parts, name)


def run_ok(ranks, scenario, timeout=300):
    r = launch(ranks, scenario, timeout=timeout, worker="parallel_workers.py")
    assert r.ok, r.describe()
    return [torch.load(r.result_path(k)) for k in range(ranks)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parity_with_one_process(name):
    ranks, layout = LAYOUTS[name]
    ref_losses, ref_state, ref_grads = reference(layers_of(layout))
    results = run_ok(ranks, layout)
    covered = set()
    for rank, res in enumerate(results):
        who = f"{name} rank {rank}"
        assert len(res["losses"]) == len(ref_losses)
        for step, (got, want) in enumerate(zip(res["losses"], ref_losses)):
            assert got == pytest.approx(want, rel=LOSS_REL), f"{who}: loss of step {step}"
        assert res["state"], f"{who}: holds no parameters"
        for pname, got in res["state"].items():
            want = expected_slice(ref_state[pname], res["specs"].get(pname), res, pname)
            assert got.shape == want.shape, f"{who}: {pname} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            scale = max(want.abs().max().item(), 1e-3)
            assert (got - want).abs().max().item() <= PARAM_ELEMENT_REL * scale, f"{who}: {pname} elementwise"
            norm_rel = ((got - want).norm() / max(want.norm().item(), 1e-6)).item()
            assert norm_rel <= PARAM_NORM_REL, f"{who}: {pname} differs by {norm_rel} in norm"
            covered.add(pname)
        if "zero=" not in layout:
            assert res["grads"], f"{who}: no gradients recorded"
            for pname, got in res["grads"].items():
                want = expected_slice(ref_grads[pname], res["specs"].get(pname), res, pname)
                scale = max(want.abs().max().item(), 1e-6)
                diff = (got - want).abs().max().item()
                assert diff <= GRAD_REL * scale, f"{who}: gradient of {pname} differs by {diff / scale} relative"
        if "pp=" in layout:
            # The executor ran exactly the compute actions of its program, in order.
            program = [a for a in res["program"] if a[0] in COMPUTE]
            assert res["trace"] == program and program, f"{who}: executed {res['trace']} but the program says {program}"
            if "schedule=zbv" in layout:  # the V: pipeline rank r runs stages r and 2 pp - 1 - r
                pp, r = int(layout.split("pp=")[1].split(",")[0]), res["pp_rank"]
                assert list(res["local_stages"]) == [r, 2 * pp - 1 - r], f"{who}: runs stages {res['local_stages']}"
        if "sp=1" in layout or "tp=" in layout:
            assert res["tp"] > 1
    # Together the ranks hold every parameter of the model.
    assert covered == set(ref_state), f"{name}: parameters nobody holds: {set(ref_state) - covered}"
    # load_state_dict(whole model) cuts it back into every rank's slices exactly.
    for res in results:
        assert res["reload_diff"] == 0.0
    # And state_dict() puts them back together (it also loaded into a plain model).
    full = results[0]["full"]
    assert set(full) == set(ref_state)
    for pname, want in ref_state.items():
        norm_rel = ((full[pname] - want).norm() / max(want.norm().item(), 1e-6)).item()
        assert norm_rel <= PARAM_NORM_REL, f"{name}: full_state_dict()[{pname!r}] differs by {norm_rel}"


@pytest.mark.parametrize("layout", ["dp=2,m=2,uneven=1", "dp=2,zero=3,uneven=1",
                                    "pp=2,dp=2,m=2,layers=4,uneven=1"])
def test_uneven_batches_train_on_the_global_batch_mean(layout):
    """A global batch of 10 held as 4 + 6 on two dp ranks (the last batch of an epoch):
    train_step's loss and gradients are the mean over all 10 samples, as one process's; the
    unweighted mean of the two ranks' means would differ by ~2% in the loss."""
    layers = layers_of(layout)
    ref_losses, ref_state = train_reference(global_batch=10, layers=layers)
    ranks = 4 if "pp=2" in layout else 2
    results = run_ok(ranks, layout)
    for rank, res in enumerate(results):
        for step, (got, want) in enumerate(zip(res["losses"], ref_losses)):
            assert got == pytest.approx(want, rel=LOSS_REL), f"{layout} rank {rank}: loss of step {step}"
    full = results[0]["full"]
    for pname, want in ref_state.items():
        norm_rel = ((full[pname] - want).norm() / max(want.norm().item(), 1e-6)).item()
        assert norm_rel <= PARAM_NORM_REL, f"{layout}: {pname} differs by {norm_rel} in norm"


def test_inconsistent_action_lists_are_refused_on_every_rank_before_running():
    results = run_ok(2, "bad_schedule", timeout=60)
    for rank, res in enumerate(results):
        assert "refuses the schedule before running it" in res["broken"], res["broken"]
        assert "per_rank[1]" in res["broken"] and "recv_activation" in res["broken"]
        assert "holds a different schedule" in res["different"], res["different"]


def test_tensor_parallel_refuses_sizes_it_cannot_split():
    errors = run_ok(3, "bad_tensor_parallel", timeout=60)[0]
    assert "tp=3 does not divide heads=4 of module 'blocks.0' (legal tp: [1, 2, 4])" in errors["heads"]
    assert "wte" in errors["vocab"] and "tp=3" in errors["vocab"] and "legal tp: 1, 2, 4, 8, 16, 32, 64" in errors["vocab"]
    assert "fc1" in errors["hidden"] and "legal tp: 1, 2, 5, 10" in errors["hidden"]


def test_forward_only_pipeline_matches_the_model():
    results = run_ok(2, "predict", timeout=60)
    assert results[0]["diff"] is None and not results[0]["is_last"]
    assert results[1]["is_last"] and results[1]["diff"] == 0.0
    for res in results:
        assert [a[0] for a in res["trace"]] == ["forward"] * 4


def test_zbv_predicts_through_the_v_and_refuses_a_tied_model_on_meta():
    results = run_ok(2, "zbv_predict_and_meta", timeout=90)
    # Rank 0 runs stages 0 and 3, so the logits are there, equal to the model's.
    assert list(results[0]["local_stages"]) == [0, 3] and list(results[1]["local_stages"]) == [1, 2]
    assert results[0]["diff"] == 0.0 and results[1]["diff"] is None
    for res in results:
        assert [a[0] for a in res["trace"]] == ["forward"] * 4
        assert res["refused"] is not None and "schedule zbv with a model on meta" in res["refused"], res["refused"]
        assert "wte.weight" in res["refused"]


def test_vocab_parallel_loss_never_holds_the_full_vocabulary():
    results = run_ok(2, "vocab_loss", timeout=60)
    vocab, hidden, tokens = 96, 8, 24
    torch.manual_seed(5)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    x = torch.randn(tokens, hidden, requires_grad=True)
    targets = torch.randint(vocab, (tokens,))
    targets[3] = -100
    want = F.cross_entropy(head(x), targets, ignore_index=-100)
    want.backward()
    for res in results:
        assert res["ops"] > 10
        assert res["widest"] == vocab // 2, f"a tensor of width {res['widest']} appeared (vocab {vocab})"
        assert res["loss"] == pytest.approx(want.item(), rel=1e-6)
        assert torch.allclose(res["x_grad"], x.grad, atol=1e-6)
        rows = slice(res["tp_rank"] * vocab // 2, (res["tp_rank"] + 1) * vocab // 2)
        assert torch.allclose(res["weight_grad"], head.weight.grad[rows], atol=1e-6)
    # Embedding with padding_idx=5 looked up [5, 6, 60, 5]: rows 6 (rank 0) and 60 - 48 = 12
    # (rank 1) get gradient one, the padding row none.
    g0, g1 = results[0]["emb_grad"], results[1]["emb_grad"]
    assert g0[5].abs().sum() == 0 and torch.all(g0[6] == 1) and torch.all(g1[12] == 1)
    assert g0.abs().sum() == g0[6].abs().sum() and g1.abs().sum() == g1[12].abs().sum()


def test_the_width_watch_sees_a_full_vocabulary_loss():
    # The control for the test above: the same watch over an ordinary loss sees width 96.
    from torch.utils._python_dispatch import TorchDispatchMode
    widths = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                widths.append(max(out.shape, default=0))
            return out

    with Watch():
        F.cross_entropy(torch.randn(24, 96, requires_grad=True), torch.randint(96, (24,))).backward()
    assert max(widths) == 96


class _Chain(torch.nn.Module):
    def __init__(self, n, reverse=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(n)])
        self.reverse = reverse

    def forward(self, x):
        for b in (reversed(self.blocks) if self.reverse else self.blocks):
            x = b(x)
        return x


def test_pipeline_cuts_only_where_the_model_allows():
    with pytest.raises(ValueError, match=r"2 blocks cannot fill 4 stages \(legal stage counts: 1..2\); "
                                         r"the model can only be cut between its blocks \['blocks.0', 'blocks.1'\]"):
        split_model(_Chain(2), 4)
    with pytest.raises(ValueError, match=r"must start at 0, never decrease"):
        split_model(_Chain(3), 2, unit_stage=[0, 1, 0])
    with pytest.raises(ValueError, match=r"do not run once each in order \(forward runs \['blocks.1', 'blocks.0'\]"):
        split_model(_Chain(2, reverse=True), 2)
    stages = split_model(_Chain(4), 2)
    x = torch.randn(3, 4)
    model = _Chain(4)
    stages = split_model(model, 2)
    mid = stages.modules[0](x)
    assert torch.equal(stages.modules[1](*mid), model(x))


def test_layout_read_from_a_plan():
    # pp=2 x tp=2 with sequence parallelism and 4 micro-batches, all taken from a pinned
    # plan that went through JSON; a plan for a 4-block model is refused by a 2-block one.
    ref_losses, ref_state, _ = reference(4)
    results = run_ok(4, "from_plan")
    for rank, res in enumerate(results):
        assert res["summary"].startswith("pp=2 dp=1 tp=2") and res["sequence_parallel"]
        assert res["micro_batches"] == 4
        assert "blocks: the plan has 4, the model has 2" in res["wrong_model"]
        for step, (got, want) in enumerate(zip(res["losses"], ref_losses)):
            assert got == pytest.approx(want, rel=LOSS_REL), f"rank {rank}: loss of step {step}"
        for pname, got in res["state"].items():
            want = expected_slice(ref_state[pname], res["specs"].get(pname), res, pname)
            norm_rel = ((got - want).norm() / max(want.norm().item(), 1e-6)).item()
            assert norm_rel <= PARAM_NORM_REL, f"rank {rank}: {pname} differs by {norm_rel} in norm"


def test_dropout_masks_differ_where_activations_are_split_and_match_elsewhere():
    r0, r1 = run_ok(2, "tp_dropout", timeout=60)
    no_sp, sp = r0[False], r0[True]
    assert no_sp["forked"] == ["blocks.0.attn_dropout"]
    assert sp["forked"] == ["blocks.0.attn_dropout", "blocks.0.resid_dropout"]
    for mode in (False, True):
        a, b = r0[mode], r1[mode]
        assert not torch.equal(a["attn"], b["attn"]), "attention dropout masks must differ across tp"
        assert torch.equal(a["emb"], b["emb"]), "embedding dropout acts on replicated activations"
        assert torch.equal(a["after"], b["after"]), "forked draws must not disturb the default generator"
        assert 0.2 < (a["attn"] == 0).float().mean() < 0.8  # it is dropout (p=0.5, rescaled by 2)
    assert torch.equal(r0[False]["resid"], r1[False]["resid"])      # replicated residual stream
    assert not torch.equal(r0[True]["resid"], r1[True]["resid"])    # sequence shards differ


def test_top_level_names_stay_the_functions():
    import torch_monarch
    import torch_monarch.hybrid  # noqa: F401  (importing the implementation modules must not shadow them)
    import torch_monarch.sharded  # noqa: F401
    import torch_monarch.tensor_parallel_modules  # noqa: F401
    for _ in range(2):
        assert torch_monarch.parallelize.__name__ == "parallelize"
        assert torch_monarch.fully_shard.__name__ == "fully_shard"
        assert torch_monarch.tensor_parallel.__name__ == "tensor_parallel"
