"""``ParallelModel.generate`` (torch_monarch/generate.py) on 4 ranks: one launch runs every case
of generate_workers.py (each rank compares with one process itself; see its docstring).

The issue's matrix: greedy generation of 64 new tokens for 4 left-padded prompts of lengths 5,
11, 3 and 8 per rank, on tp=2 (x dp=2, each dp replica its own prompts), tp=4, pp=2 (x dp=2) and
tp=2 x pp=2, for examples/models.py's Llama (GQA) and GPT-2 (their pipeline stages cut by torch.fx)
and Hugging Face Llama, Qwen2 (GQA) and GPT-2 (stages cut by module hooks): token-for-token equal
to one process (HF's own ``generate(do_sample=False)``; for ours a loop without a cache, each
prompt alone), each rank's cache holding its kv heads / tp of its stage's layers only.

Beside it, 16 new tokens: ZeRO-1/3 under tp and dp=4 (Qwen2, Qwen3, Mistral, our Llama), an fx-cut
pipeline under ZeRO-3, EOS (tp, dp=4 ZeRO-3 where ranks finish apart, pipelines of both cuts).
Micro-batched pipelined decode (the rows in 2 or 4 groups following each other round the stages):
64 tokens on our Llama tp=2 x pp=2 and HF Qwen2 pp=2, and with EOS (groups whose rows all stopped
are skipped; under ZeRO-3 the dp ranks agree group by group), equal to one process.
Gemma 2 (sliding-window layers, window 8, alternating with full-attention ones) on pp=2 x dp=2, 64
tokens: each stage sizes each kind's mask from its own first layer of that kind.
Sampled (temperature, top-k, top-p, seed): every rank the same, and equal to HF's sampling from
the global RNG seeded alike. EOS: rows stop and emit padding; all finished -> the loop ends early.
"""

import pytest
import torch

from dist_harness import launch

NEW, LONG_NEW, WIDTH, PAD = 16, 64, 11, 0
MATRIX_MODELS = ("ours_llama_gqa", "ours_gpt2_4l", "hf_llama_gqa", "hf_qwen2_gqa", "hf_gpt2_4l")
MATRIX_TP = {"tp2": 2, "tp4": 4, "pp2": 1, "tp2_pp2": 2}
MATRIX = [f"{m}_{layout}_64" for m in MATRIX_MODELS for layout in MATRIX_TP]
# micro-batched pipelined decode (the rows in groups following each other round the stages)
MICRO = ["ours_llama_gqa_tp2_pp2_m2_64", "hf_qwen2_gqa_pp2_m4_64"]
GREEDY = ["llama_tp2", "qwen2_tp2_zero3", "qwen3_tp2_zero1", "mistral_dp4_zero3", "llama_tp2_trained",
          "ours_llama_dp4_zero3", "ours_llama_pp2_zero3", "hf_llama_gqa_tp2_dynamic", "ours_llama_gqa_pp2_dynamic",
          "hf_gemma2_window8_pp2_64"]
# key/value heads each rank's cache holds: the model's kv heads / tp (the matrix's models have 4)
KV_HEADS = {"llama_tp2": 1, "qwen2_tp2_zero3": 1, "qwen3_tp2_zero1": 1, "mistral_dp4_zero3": 2,
            "llama_tp2_trained": 1, "ours_llama_dp4_zero3": 2, "ours_llama_pp2_zero3": 2, "llama_tp2_sampled": 1,
            "ours_llama_gqa_tp2_pp2_m2_64": 2, "hf_qwen2_gqa_pp2_m4_64": 4, "hf_llama_gqa_tp2_dynamic": 2,
            "ours_llama_gqa_pp2_dynamic": 4, "hf_gemma2_window8_pp2_64": 4,
            **{f"{m}_{layout}_64": 4 // tp for m in MATRIX_MODELS for layout, tp in MATRIX_TP.items()}}


@pytest.fixture(scope="module")
def results():
    r = launch(4, "all", timeout=300, worker="generate_workers.py")
    assert r.ok, r.describe()
    return [torch.load(r.result_path(rank)) for rank in range(4)]


def _no_errors(results, case):
    for rank, res in enumerate(results):
        assert "error" not in res[case], f"{case} on rank {rank}: {res[case]['error']}"


@pytest.mark.parametrize("case", MATRIX + MICRO + GREEDY)
def test_greedy_generation_equals_one_process(results, case):
    _no_errors(results, case)
    new = LONG_NEW if case.endswith("_64") else NEW
    # the default cache is pre-allocated for prompt + new tokens (as the planner counts it)
    static = not case.endswith("_dynamic")
    for rank, res in enumerate(results):
        r = res[case]
        assert r["out"].shape == (4, WIDTH + new), f"{case} rank {rank}"
        assert r["equal"], f"{case} rank {rank}:\n{r['out'][:, WIDTH:]}\none process:\n{r['ref'][:, WIDTH:]}"
        assert r["kv_heads"] == KV_HEADS[case], f"{case} rank {rank}: the cache holds {r['kv_heads']} kv heads"
    # the tp ranks of one dp replica emit the same tokens (they are checked against the same reference)
    by_dp = {}
    for res in results:
        by_dp.setdefault(res[case]["dp_rank"], []).append(res[case]["out"])
        assert res[case]["capacity"] == (WIDTH + new if static else None), (case, res[case]["capacity"])
        if "_gqa_" in case and static:  # head dim 64 / 8: 4 rows x layers here x k,v x kv heads here x fp32
            r = res[case]
            assert r["kv_cache_bytes"] == 4 * len(r["filled_layers"]) * 2 * r["kv_heads"] * (WIDTH + new) * 8 * 4, r
        layers = 4 if case.endswith("_64") or "_gqa_" in case else 2
        if "pp2" in case:  # each stage's cache holds its own layers only
            half = layers // 2
            assert res[case]["filled_layers"] == list(range(res[case]["pp_rank"] * half,
                                                            (res[case]["pp_rank"] + 1) * half)), res[case]
        else:
            assert res[case]["filled_layers"] == list(range(layers)), res[case]
    for outs in by_dp.values():
        assert all(torch.equal(o, outs[0]) for o in outs)
    if case == "hf_gemma2_window8_pp2_64":  # per stage: a sliding layer's 8 positions, a full one's 75
        for res in results:  # 4 rows x k,v x 4 kv heads x head dim 8 x fp32
            assert res[case]["kv_cache_bytes"] == 4 * (8 + WIDTH + new) * 2 * 4 * 8 * 4, res[case]
    if len(by_dp) > 1:  # dp replicas had their own prompts
        assert not torch.equal(by_dp[0][0], by_dp[1][0])


@pytest.mark.parametrize("layout", list(MATRIX_TP))
def test_only_the_first_two_steps_collectives_are_checked(results, layout):
    """generate turns the agreement checks off on tp / pp / dp after two steps (each check is an
    all-gather of its own): a generate of 64 tokens checks exactly what one of 2 tokens checks,
    and the checks are on again afterwards."""
    case = f"ours_llama_gqa_{layout}_64"
    _no_errors(results, case)
    for res in results:
        r = res[case]
        assert r["checks_on_after"]
        assert r["checked"] == r["checked_two_tokens"], r
        assert any(r["checked"]) == (MATRIX_TP[layout] > 1), r  # pp's messages are never checked
        if MATRIX_TP[layout] > 1:
            # The tp group's ranks share the node (it is marked node-local): its small
            # all-reduces take the shared-memory path (on by default), a decode's every step.
            assert r["tp_node_local"], r
            assert r["tp_node_all_reduces"] >= LONG_NEW, r


def test_sampled_generation_is_the_same_on_every_rank_and_equals_hf_sampling(results):
    case = "llama_tp2_sampled"
    _no_errors(results, case)
    outs = [res[case]["out"] for res in results]
    assert all(torch.equal(o, outs[0]) for o in outs)  # same prompts and seed on all 4 ranks
    assert all(res[case]["equal"] for res in results)  # HF's do_sample=True, torch.manual_seed(7)
    greedy = [res["llama_tp2"]["out"] for res in results if res["llama_tp2"]["dp_rank"] == 0][0]
    assert not torch.equal(outs[0], greedy)  # it did sample


@pytest.mark.parametrize("case,stops_early", [("llama_tp2_eos", False), ("ours_gpt2_tp2_eos", True),
                                              ("qwen2_pp2_dp2_eos", False), ("ours_gpt2_pp2_eos", True),
                                              ("ours_gpt2_pp2_eos_m2", True), ("ours_gpt2_pp2_zero3_eos_m2", True)])
def test_sequences_stop_at_eos(results, case, stops_early):
    _no_errors(results, case)
    for rank, res in enumerate(results):
        r = res[case]
        assert r["equal"], f"{case} rank {rank}:\n{r['out'][:, WIDTH:]}\none process:\n{r['ref'][:, WIDTH:]}"
    # the EOS id is what dp rank 0's prompt 0 emits 4th: that row stops there and pads
    r0 = results[0][case]["out"]
    eos = int(r0[0, WIDTH + 3])
    assert (r0[0, WIDTH:WIDTH + 3] != eos).all() and (r0[0, WIDTH + 4:] == PAD).all()
    # ours_gpt2: dp rank 1's 4 sequences all finish within 6 tokens, and its loop stops there
    assert stops_early == any(res[case]["out"].shape[1] < WIDTH + NEW for res in results), case


@pytest.mark.parametrize("case,layout", [("ours_llama_gqa_planned_pp2", (2, 1, 2, 2)),
                                         ("hf_llama_gqa_planned", (1, 1, 4, 1))])
def test_parallelize_in_inference_mode_lays_out_the_inference_plan(results, case, layout):
    """parallelize(mode="inference", batch=4, prompt_len=11, max_new_tokens=16) on the cpu preset:
    the latency objective takes dp=4 replicas of the whole model (the fewest devices per replica
    among the tied), and with pp=2 pinned 2 decode micro-batches, which generate uses; the
    output equals one process."""
    _no_errors(results, case)
    for res in results:
        r = res[case]
        planned = r["planned"]
        assert (planned["pp"], planned["tp"], planned["dp"], planned["decode_micro_batches"]) == layout, planned
        assert r["micro_batches_used"] == planned["decode_micro_batches"]
        assert r["equal"], f"{case}:\n{r['out'][:, WIDTH:]}\none process:\n{r['ref'][:, WIDTH:]}"


def test_a_trained_model_generates_from_its_trained_weights(results):
    """One train_step + AdamW step (training mode), then generate: equal to HF's generate on the
    parallel model's whole state dict; the model is back in training mode afterwards."""
    for res in results:
        r = res["llama_tp2_trained"]
        assert r["training_before"] and r["training_after"] and r["equal"]


@pytest.mark.parametrize("case,message", [
    ("negative_new_tokens", r"generate: max_new_tokens must be an int >= 0, got -1"),
    ("micro_batches_without_pipeline", r"generate: micro_batches=2 splits the batch round a pipeline; this "
                                       r"layout has pp=1"),
    ("more_micro_batches_than_rows", r"generate: micro_batches=5 is more than the batch \(4 sequences\)"),
    ("too_long", r"generate: the prompt \(11 tokens\) and max_new_tokens=54 need 65 positions; the model has 64 "
                 r"\(GPT2Config.max_position_embeddings\)"),
])
def test_bad_input_is_one_clear_error(results, case, message):
    import re
    for res in results:
        assert "error" not in res[case], res[case]["error"]
        assert res[case]["error_raised"] and re.search(message, res[case]["error_raised"]), res[case]


def test_examples_models_cache_path_matches_the_plain_forward():
    """One process: examples/models.py's GPT-2 and Llama with a KVCache (prefill of a
    left-padded batch, then one token at a time) give the plain forward's last logits for
    each unpadded prompt; without cache= the forward is the same function as before."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import models as M
    torch.manual_seed(0)
    for model in (M.GPT2LMHeadModel(vocab=64, hidden=32, heads=4, layers=2, max_positions=32),
                  M.LlamaForCausalLM(vocab=64, hidden=32, heads=4, kv_heads=2, intermediate=64, layers=2)):
        model.eval()
        rows = [torch.randint(0, 64, (n,)) for n in (3, 6)]
        ids = torch.zeros(2, 6, dtype=torch.long)
        mask = torch.zeros(2, 6, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, 6 - len(r):], mask[i, 6 - len(r):] = r, 1
        cache = model.new_cache()
        cache.attention_mask, cache.positions = mask, (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            last = model(ids, cache=cache)[:, -1]
            nxt = torch.tensor([[5], [7]])
            cache.attention_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            cache.positions = cache.positions[:, -1:] + 1
            step = model(nxt, cache=cache)[:, -1]
            for i, r in enumerate(rows):
                torch.testing.assert_close(last[i], model(r[None])[0, -1], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(step[i], model(torch.cat([r, nxt[i]])[None])[0, -1], rtol=1e-5, atol=1e-5)


def test_zero3_ranks_step_together_and_each_returns_its_own_length(results):
    """dp=4 under ZeRO-3, EOS: the dp ranks' sequences finish at different steps (outputs of
    17, 19, 24 and 27 columns), every rank ran all 16 forwards (each gathers parameters over
    dp, so none may stop alone), and each returns what one process returns for its prompts."""
    case = "ours_gpt2_dp4_zero3_eos"
    _no_errors(results, case)
    widths = set()
    for res in results:
        r = res[case]
        assert r["equal"], f"{case}:\n{r['out'][:, WIDTH:]}\none process:\n{r['ref'][:, WIDTH:]}"
        assert r["cache_len"] == WIDTH + NEW - 1
        widths.add(r["out"].shape[1])
    assert len(widths) > 1 and min(widths) < WIDTH + NEW


# Shared-memory all-reduces per generated token (the prefill and each decode step) on the
# default path: 2 per block, the embedding's (our GPT-2: token and position tables, each split
# over tp), and where the head splits the vocabulary (our GPT-2) the logits' gather. Over Gloo
# the gather was one call fewer.
SHARED = {"hf_llama_gqa_tp4_64": 2 * 4 + 1, "ours_gpt2_4l_tp4_64": 2 * 4 + 2 + 1, "llama_tp2_sampled": 2 * 2 + 1}


@pytest.mark.parametrize("case", list(SHARED))
def test_tp_decode_runs_through_the_nodes_shared_memory(results, case):
    """By default tp's small all-reduces (and the vocabulary-split logits' gather, an all-reduce
    of each rank's part beside zeros) run through the node's shared memory: every generated
    token's tp collectives, counted exactly."""
    _no_errors(results, case)
    new = LONG_NEW if case.endswith("_64") else NEW
    for rank, res in enumerate(results):
        r = res[case]
        assert r["tp_node_local"], r
        assert r["tp_node_all_reduces"] == new * SHARED[case], (case, rank, r["tp_node_all_reduces"])


@pytest.fixture(scope="module")
def gloo_results():
    """The same cases with the shared-memory path off (MONARCH_NODE_ALL_REDUCE_BYTES=0): every tp
    collective over Gloo, the logits gathered by Gloo's all-gather."""
    r = launch(4, ",".join(SHARED), timeout=300, worker="generate_workers.py",
               env={"MONARCH_NODE_ALL_REDUCE_BYTES": "0"})
    assert r.ok, r.describe()
    return [torch.load(r.result_path(rank)) for rank in range(4)]


@pytest.mark.parametrize("case", list(SHARED))
def test_generation_over_gloo_alone_equals_one_process(gloo_results, results, case):
    _no_errors(gloo_results, case)
    for rank, res in enumerate(gloo_results):
        r = res[case]
        assert r["equal"], f"{case} rank {rank}:\n{r['out'][:, WIDTH:]}\none process:\n{r['ref'][:, WIDTH:]}"
        assert r["tp_node_all_reduces"] == 0, (case, rank, r["tp_node_all_reduces"])
        assert torch.equal(r["out"], results[rank][case]["out"])  # the same tokens either way
