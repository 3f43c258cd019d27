"""Context parallelism (torch_monarch.context_parallel over monarch::cp): ring attention and
training parity with one process, on 4 ranks in one launch (context_parallel_workers.py).

Parity setup: fp32, AdamW (lr 1e-2), 6 steps (two batches in turn), batch 4 x 16 tokens, a Llama-style model
(rotary positions, 4 query heads over 2 key/value heads) on cp=4, dp=2 x cp=2 and
cp=2 x tp=2, and a GPT-2-style model (learned positions, tied head) on dp=2 x cp=2; the
reference is the same model on the whole batch and sequence in one process. Tolerances, as
test_parallel.py's and for the same reasons:
  * each step's loss within 1e-5 relative (float32 summation order: blockwise softmax,
    the loss as a mean of per-rank means, gradient averages over 2-4 ranks);
  * step-0 gradients: every element within 1e-5 of the reference tensor's largest magnitude
    (each rank's gradient, after the dp x cp average, is the whole model's gradient, or the
    matching tp slice of it);
  * final parameters: 1e-5 relative in norm, every element within 3e-4 of the tensor's
    largest magnitude. Adam divides by sqrt(v), so an element whose gradient is tiny moves by
    ~lr whatever its size and keeps the gradient's relative rounding noise: the largest
    element difference seen, 1.4e-4 of its tensor's scale, is in GPT-2's second-layer q
    projection at an element whose step-0 gradient is 3e-9 (~1e-5 of the tensor's largest
    gradient; attention is near uniform at initialization); test_parallel.py saw 7.3e-5 for
    the same reason with a smaller learning rate.
Ring attention alone is checked in float64 against plain attention, where the only
difference is the summation order: 1e-12 relative.
"""

import functools

import pytest
import torch

from context_parallel_workers import TRAIN_LAYOUTS, train_reference
from dist_harness import launch
from torch_monarch import _runtime

LOSS_REL = 1e-5
GRAD_REL = 1e-5
PARAM_NORM_REL = 1e-5
PARAM_ELEMENT_REL = 3e-4
RING_REL = 1e-12
WORLD = 4


@functools.lru_cache(maxsize=None)
def launched():
    r = launch(WORLD, "all", timeout=240, worker="context_parallel_workers.py")
    assert r.ok, r.describe()
    return [torch.load(r.result_path(rank)) for rank in range(WORLD)]


@functools.lru_cache(maxsize=None)
def reference(kind):
    losses, grads, state = train_reference(kind)
    assert losses[-1] < losses[0] - 0.02, f"the reference does not train: {losses}"
    return losses, grads, state


def expected(ref, dim, result, name):
    return ref if dim is None else _runtime.shard_tensor(ref, dim, result["tp_rank"], result["tp"], 1, name)


@pytest.mark.parametrize("causal, rows", [(True, 0), (False, 0), (True, 5)])
def test_ring_attention_equals_plain_attention(causal, rows):
    for rank, result in enumerate(launched()):
        errors = result["ring"][f"causal={causal},rows={rows}"]
        for what, err in errors.items():
            assert err < RING_REL, f"rank {rank}, causal={causal}: {what} differs by {err:.3g} of its scale"


def test_ring_attention_bf16_accumulates_in_float32():
    # bf16 output rounding is 2^-8 relative (0.4%); float32 accumulation keeps the rest small.
    for result in launched():
        assert result["ring"]["bf16"]["dtype"] == "torch.bfloat16"
        assert result["ring"]["bf16"]["rel"] < 1e-2


def test_ring_attention_sends_the_predicted_bytes():
    # b=2, kv_heads=4, local 64 tokens, d=16, float32, cp=4: forward (cp-1) x (k + v) of this
    # rank's chunk = 3 x 2 x 2*4*64*16 x 4 B = 196608 B; backward the same again plus the
    # gradient accumulators: exactly twice.
    for result in launched():
        b = result["ring"]["bytes"]
        assert b["predicted"] == (196608.0, 393216.0)
        assert b["forward"] == b["predicted"][0]
        assert b["backward"] == b["predicted"][1]


def test_bad_inputs_are_one_clear_error_on_every_rank():
    for rank, result in enumerate(launched()):
        e = result["ring"]["errors"]
        assert "sequence length 12 (dim 1 of [2, 12, 4]) does not split into 2*cp = 8" in e["indivisible"]
        assert "q [1, 4, 8, 8], k [1, 2, 6, 8], v [1, 2, 6, 8] do not fit" in e["shapes"]
        assert "3 heads, which do not divide q's 4" in e["heads"]
        assert "local sequence length 7 is odd" in e["odd"]
        assert "called it with different inputs" in e["ranks_differ"]
        assert "rank 0: q [1, 2, 8, 8]" in e["ranks_differ"] and "rank 3: q [1, 2, 4, 8]" in e["ranks_differ"]
        assert "found no attention module it can convert in Sequential" in e["no_attention"]
        assert "nn.MultiheadAttention at ['mha'] is not supported" in e["multihead"]
        assert "indexed with positions other than 0..1" in e["positions"]
        assert "context_parallel: module 'transformer.wpe' is already converted" in e["twice"]
        assert result["ring"]["usable_after_errors"], f"rank {rank}: the cp group failed after refused inputs"


@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
def test_training_parity_with_one_process(layout):
    kind, dp, cp, tp = TRAIN_LAYOUTS[layout]
    ref_losses, ref_grads, ref_state = reference(kind)
    for rank, all_results in enumerate(launched()):
        result = all_results[layout]
        where = f"{layout}, rank {rank}"
        assert result["local_tokens"] == 4 * 16 // (dp * cp), where
        expected_converted = {"llama": {"attention", "rotary"}, "gpt2": {"attention", "positions"}}[kind]
        assert set(result["converted"].values()) == expected_converted, where
        for step, (got, want) in enumerate(zip(result["losses"], ref_losses)):
            assert abs(got - want) <= LOSS_REL * abs(want), f"{where}: step {step} loss {got} vs {want}"
        assert len(result["losses"]) == len(ref_losses)
        assert set(result["grads"]) == set(ref_grads), where
        for name, grad in result["grads"].items():
            want = expected(ref_grads[name], result["specs"].get(name), result, name)
            err = (grad - want).abs().max().item()
            assert err <= GRAD_REL * want.abs().max().item(), f"{where}: step-0 gradient of {name} off by {err:.3g}"
        for name, param in result["state"].items():
            want = expected(ref_state[name], result["specs"].get(name), result, name)
            if name.endswith("c_attn.bias"):
                # The key bias adds the same number to every score of a query row, so its true
                # gradient is exactly zero and its float gradient is rounding noise, which
                # Adam turns into steps of ~lr of either sign (docs/runtime.md, Tests): its
                # final values compare nothing. Its step-0 gradient was checked above.
                third = want.numel() // 3
                keep = torch.cat([torch.arange(third), torch.arange(2 * third, 3 * third)])
                param, want = param[keep], want[keep]
            scale = want.abs().max().item()
            assert (param - want).norm().item() <= PARAM_NORM_REL * want.norm().item(), f"{where}: {name}"
            err = (param - want).abs().max().item()
            assert err <= PARAM_ELEMENT_REL * scale, f"{where}: {name} off by {err:.3g} of {scale:.3g}"
