"""Worker for test_generate.py: ``ParallelModel.generate`` on 4 ranks, every case in one launch.

Each case lays a small model out by hand (a mesh, no planning), generates this rank's batch of 4
left-padded prompts of different lengths, and compares with one process on this rank:
  * Hugging Face models: HF's own ``model.generate`` (greedy: ``do_sample=False``; sampled: the
    global RNG seeded with the same seed, the same temperature / top-k / top-p);
  * examples/models.py's GPT-2 and Llama: a one-process greedy loop without any cache, each
    prompt alone and unpadded (the full forward over the sequence so far, argmax of the last
    position).
Pipelines (HF models, stages cut by hooks) are laid out by the planner with pins (the hook cut
needs the model read on an example batch). Every dp rank has its own prompts (seeded by its dp coordinate) unless the case says
``same_prompts``; the tp ranks of one dp replica have the same. Each rank writes
MONARCH_TEST_OUTPUT/rank<r>.pt: {case: {"out", "ref", "equal", "kv_heads", "seconds", "error"}}.
"""

import copy
import os
import sys
import time

import torch

from dist_harness import run_worker
from hf_models import VOCAB, build

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import models as ours  # noqa: E402

NEW = 16
LENGTHS = (5, 11, 3, 8)
PAD = 0


def prompts(seed):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]
    width = max(LENGTHS)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return rows, ids, mask


def spread(model, std=0.3):
    """Weights of std 0.3 instead of 0.02: a random tiny model at 0.02 emits one token over and
    over, which would make "token-for-token equal" a weak check."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model


# The matrix: 64 new tokens on tp=2, tp=4, pp=2 and tp=2 x pp=2 for our two models and
# three Hugging Face architectures; 4 layers (2 per pipeline stage), 128 positions, and for the
# Llama-style ones 8 query heads sharing 4 key/value heads (GQA; tp=4 divides them).
MATRIX_MODELS = ("ours_llama_gqa", "ours_gpt2_4l", "hf_llama_gqa", "hf_qwen2_gqa", "hf_gpt2_4l")
MATRIX_LAYOUTS = {"tp2": {"tp": 2, "dp": 2}, "tp4": {"tp": 4}, "pp2": {"pp": 2, "dp": 2}, "tp2_pp2": {"pp": 2, "tp": 2}}
LONG_NEW = 64


def _matrix_model(kind):
    import transformers as T
    from hf_models import _no_dropout, _small
    torch.manual_seed(0)
    gqa = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    if kind == "ours_llama_gqa":
        return spread(ours.LlamaForCausalLM(vocab=VOCAB, hidden=64, heads=8, kv_heads=4, intermediate=128, layers=4))
    if kind == "ours_gpt2_4l":
        return spread(ours.GPT2LMHeadModel(vocab=VOCAB, hidden=64, heads=4, layers=4, max_positions=128))
    if kind == "hf_llama_gqa":
        model = T.LlamaForCausalLM(_small(T.LlamaConfig, **gqa))
    elif kind == "hf_qwen2_gqa":
        model = T.Qwen2ForCausalLM(_small(T.Qwen2Config, **gqa))
    elif kind == "hf_gemma2_window8":
        # sliding-window layers (window 8, far shorter than the 75 positions) alternating with
        # full-attention ones: Hugging Face sizes each kind's mask from the cache of the kind's
        # first layer, which the second pipeline stage does not hold
        model = T.Gemma2ForCausalLM(_small(T.Gemma2Config, **gqa, head_dim=8, sliding_window=8))
    else:
        model = T.GPT2LMHeadModel(_no_dropout(T.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=VOCAB,
                                                           n_positions=128)))
    model = spread(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def build_case(kind):
    if kind in MATRIX_MODELS or kind == "hf_gemma2_window8":
        return _matrix_model(kind)
    if kind == "ours_gpt2":
        torch.manual_seed(0)
        return spread(ours.GPT2LMHeadModel(vocab=VOCAB, hidden=64, heads=4, layers=2, max_positions=64))
    if kind == "ours_llama":
        torch.manual_seed(0)
        return spread(ours.LlamaForCausalLM(vocab=VOCAB, hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2))
    model = spread(build(kind))
    model.generation_config.eos_token_id = None  # HF's config default (2) would stop it: we pass eos explicitly
    model.generation_config.pad_token_id = PAD
    return model


def hf_reference(model, ids, mask, args):
    kw = dict(max_new_tokens=args.get("max_new_tokens", NEW), pad_token_id=PAD,
              eos_token_id=args.get("eos_token_id"))
    if args.get("temperature", 0) > 0:
        torch.manual_seed(args.get("seed", 0))
        kw.update(do_sample=True, temperature=args["temperature"], top_k=args.get("top_k") or 0,
                  top_p=args.get("top_p") or 1.0)
    else:
        kw.update(do_sample=False)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **kw)


def ours_reference(model, rows, width, args):
    """Each prompt alone, no cache, no padding: the full forward each step, argmax."""
    out = []
    eos = args.get("eos_token_id")
    with torch.no_grad():
        for r in rows:
            t = r[None]
            gen = []
            for _ in range(args.get("max_new_tokens", NEW)):
                tok = model(t)[:, -1].argmax(-1)
                gen.append(int(tok))
                t = torch.cat([t, tok[:, None]], 1)
                if eos is not None and int(tok) == eos:
                    break
            out.append(gen)
    n = max(len(g) for g in out)
    res = torch.full((len(rows), width + n), PAD, dtype=torch.long)  # finished rows emit PAD, as HF's
    for i, (r, g) in enumerate(zip(rows, out)):
        res[i, width - len(r):width] = r
        res[i, width:width + len(g)] = torch.tensor(g)
    return res


def run_case(name, spec, rank):
    import torch_monarch
    kind, mesh_kw, zero, args = spec["model"], spec.get("mesh"), spec.get("zero_stage", 0), dict(spec.get("args", {}))
    result = {}
    model = build_case(kind)
    reference = copy.deepcopy(model).eval()
    if "inference" in spec:  # planned by the inference objective (parallelize(mode="inference"))
        from torch_monarch import planner
        _, ids, mask = prompts(100)
        pm = torch_monarch.parallelize(model, example_input={"input_ids": ids[:2], "attention_mask": mask[:2]}
                                       if not kind.startswith("ours") else ids[:2], mode="inference",
                                       cluster=planner.cluster("cpu", 4), **spec["inference"])
        mesh = pm.mesh
        inf = pm.plan.inference
        result["planned"] = dict(pp=pm.pp, tp=pm.tp, dp=pm.dp, decode_micro_batches=inf.decode_micro_batches,
                                 per_token_s=inf.prediction.per_token_s)
    elif "plan" in spec:  # hook-cut pipelines (HF) need the model read on an example batch: planned with pins
        _, ids, mask = prompts(100)
        pm = torch_monarch.parallelize(model, example_input={"input_ids": ids[:2], "attention_mask": mask[:2]},
                                       global_batch=8, **spec["plan"])
        mesh = pm.mesh
    else:
        mesh = torch_monarch.device_mesh(**mesh_kw)
        pm = torch_monarch.parallelize(model, mesh=mesh, zero_stage=zero)
    dp_rank = mesh.coordinate("dp")
    rows, ids, mask = prompts(100 if spec.get("same_prompts") else 100 + dp_rank)
    result["pp_rank"] = mesh.coordinate("pp")
    result.update(dp_rank=dp_rank, tp_rank=mesh.coordinate("tp"))
    if spec.get("train_first"):
        # One AdamW step first (training mode), then generation from the trained weights, against
        # one process holding the parallel model's whole state dict.
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        labels = ids.masked_fill(mask == 0, -100)
        pm.train()
        pm.train_step({"input_ids": ids, "attention_mask": mask, "labels": labels})
        opt.step()
        state = pm.state_dict()
        reference.load_state_dict(state)
        result["training_before"] = pm._plain[0].training
    if "error_args" in spec:
        try:
            pm.generate(ids, **spec["error_args"](ids, mask))
            result["error_raised"] = None
        except ValueError as e:
            result["error_raised"] = str(e)
        return result
    groups = [mesh.group(n) for n in ("tp", "pp", "dp") if mesh.group(n).size > 1]
    checked = [g.collectives_checked for g in groups]
    tp = mesh.group("tp")
    node_before = tp.node_all_reduces
    start = time.perf_counter()
    out = pm.generate(ids, attention_mask=mask, max_new_tokens=args.pop("max_new_tokens", NEW), pad_token_id=PAD,
                      **args)
    result["seconds"] = time.perf_counter() - start
    # Agreement checks: only the first two steps' collectives are checked, and the checks are
    # back on afterwards (the same count as a generate of 2 tokens).
    result["checked"] = [g.collectives_checked - c for g, c in zip(groups, checked)]
    result["checks_on_after"] = all(g.checks_collectives for g in groups)
    result["tp_node_local"] = tp.node_local
    result["tp_node_all_reduces"] = tp.node_all_reduces - node_before  # the shared-memory path's calls
    args = dict(spec.get("args", {}))
    if spec.get("train_first"):
        result["training_after"] = pm._plain[0].training
    ref = ours_reference(reference, rows, ids.shape[1], args) if kind.startswith("ours") \
        else hf_reference(reference, ids, mask, args)
    stats = pm.generate_stats  # what this rank's caches held (the caches are let go with the call)
    result["stage_layers"] = [i for i, s in enumerate(pm.layout.block_stage) if s == pm.local_stages[0]]
    result.update(filled_layers=stats["layers"], capacity=stats["capacity"], kv_heads=stats["kv_heads"],
                  cache_len=stats["positions"], micro_batches_used=stats["micro_batches"],
                  kv_cache_bytes=stats["kv_cache_bytes"])
    result.update(out=out, ref=ref, equal=torch.equal(out, ref))
    if spec.get("count_checks"):  # the same generate for 2 tokens: what its checks count
        checked = [g.collectives_checked for g in groups]
        pm.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD,
                    **{k: v for k, v in args.items() if k != "max_new_tokens"})
        result["checked_two_tokens"] = [g.collectives_checked - c for g, c in zip(groups, checked)]
    return result


def _too_long(ids, mask):
    return dict(attention_mask=mask, max_new_tokens=64 - ids.shape[1] + 1)


CASES = {
    # Hugging Face models against HF's own generate
    "llama_tp2": {"model": "llama", "mesh": {"tp": 2}},
    "qwen2_tp2_zero3": {"model": "qwen2", "mesh": {"tp": 2}, "zero_stage": 3},
    "qwen3_tp2_zero1": {"model": "qwen3", "mesh": {"tp": 2}, "zero_stage": 1},
    "mistral_dp4_zero3": {"model": "mistral", "mesh": {"tp": 1}, "zero_stage": 3},
    "llama_tp2_eos": {"model": "llama", "mesh": {"tp": 2}, "args": {"eos_token_id": "auto"}},
    "llama_tp2_sampled": {"model": "llama", "mesh": {"tp": 2}, "same_prompts": True,
                          "args": {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}},
    "llama_tp2_trained": {"model": "llama", "mesh": {"tp": 2}, "train_first": True},
    # examples/models.py against a one-process loop without cache
    "ours_llama_dp4_zero3": {"model": "ours_llama", "mesh": {"tp": 1}, "zero_stage": 3},
    "ours_gpt2_tp2_eos": {"model": "ours_gpt2", "mesh": {"tp": 2}, "args": {"eos_token_id": "auto"}},
    # ZeRO-3 gathers in every forward: dp ranks whose sequences finish at different steps keep
    # stepping together, and each returns what it would alone
    "ours_gpt2_dp4_zero3_eos": {"model": "ours_gpt2", "mesh": {"tp": 1}, "zero_stage": 3,
                                "args": {"eos_token_id": "auto"}},
    # pipelines: an fx-cut stage under ZeRO-3 (its wrapper gathers), GPT-2's embedding tied to
    # its head across fx-cut stages with EOS, a hook-cut one with EOS
    "ours_llama_pp2_zero3": {"model": "ours_llama", "mesh": {"pp": 2}, "zero_stage": 3},
    "ours_gpt2_pp2_eos": {"model": "ours_gpt2", "mesh": {"pp": 2}, "args": {"eos_token_id": "auto"}},
    "qwen2_pp2_dp2_eos": {"model": "qwen2", "plan": {"pp": 2, "dp": 2}, "args": {"eos_token_id": "auto"}},
    # micro-batched decode: the rows in 2 or 4 groups following each other round the pipeline;
    # with EOS a group whose rows all stopped is skipped from then on (under ZeRO-3 the dp ranks
    # agree group by group)
    "ours_llama_gqa_tp2_pp2_m2_64": {"model": "ours_llama_gqa", "mesh": {"pp": 2, "tp": 2},
                                     "args": {"max_new_tokens": 64, "micro_batches": 2}},
    "hf_qwen2_gqa_pp2_m4_64": {"model": "hf_qwen2_gqa", "plan": {"pp": 2, "dp": 2},
                               "args": {"max_new_tokens": 64, "micro_batches": 4}},
    "ours_gpt2_pp2_eos_m2": {"model": "ours_gpt2", "mesh": {"pp": 2}, "args": {"eos_token_id": "auto",
                                                                             "micro_batches": 2}},
    "ours_gpt2_pp2_zero3_eos_m2": {"model": "ours_gpt2", "mesh": {"pp": 2}, "zero_stage": 3,
                                   "args": {"eos_token_id": "auto", "micro_batches": 2}},
    # sliding-window and full-attention layers in each pipeline stage's cache
    "hf_gemma2_window8_pp2_64": {"model": "hf_gemma2_window8", "plan": {"pp": 2, "dp": 2},
                                 "args": {"max_new_tokens": 64}},
    # the KV cache grown token by token instead of pre-allocated (the default)
    "hf_llama_gqa_tp2_dynamic": {"model": "hf_llama_gqa", "mesh": {"tp": 2}, "args": {"cache": "dynamic"}},
    "ours_llama_gqa_pp2_dynamic": {"model": "ours_llama_gqa", "mesh": {"pp": 2}, "args": {"cache": "dynamic"}},
    # laid out by the inference planner (pp pinned; the plan's decode micro-batches used)
    "ours_llama_gqa_planned_pp2": {"model": "ours_llama_gqa", "inference": {"batch": 4, "prompt_len": 11,
                                                                         "max_new_tokens": 16, "pp": 2}},
    "hf_llama_gqa_planned": {"model": "hf_llama_gqa", "inference": {"batch": 4, "prompt_len": 11,
                                                                     "max_new_tokens": 16}},
    # refused
    "negative_new_tokens": {"model": "llama", "mesh": {"tp": 2},
                            "error_args": lambda ids, mask: dict(attention_mask=mask, max_new_tokens=-1)},
    "too_long": {"model": "gpt2", "mesh": {"tp": 2}, "error_args": _too_long},
    "micro_batches_without_pipeline": {"model": "ours_llama", "mesh": {"tp": 2},
                                       "error_args": lambda ids, mask: dict(max_new_tokens=4, micro_batches=2)},
    "more_micro_batches_than_rows": {"model": "ours_llama", "mesh": {"pp": 2},
                                     "error_args": lambda ids, mask: dict(max_new_tokens=4, micro_batches=5)},
}
# The matrix: our models laid out by meshes (torch.fx cuts their pipeline stages), the Hugging
# Face ones' pipelines by pinned plans (module hooks cut them: the model read on an example batch).
for _model in MATRIX_MODELS:
    for _layout, _mesh in MATRIX_LAYOUTS.items():
        _case = {"model": _model, "args": {"max_new_tokens": LONG_NEW}}
        if _model.startswith("hf_") and "pp" in _mesh:
            _case["plan"] = dict(_mesh)
        else:
            _case["mesh"] = dict(_mesh)
        _case["count_checks"] = _model == "ours_llama_gqa"
        CASES[f"{_model}_{_layout}_64"] = _case


def resolve_eos(spec):
    """An EOS id that the greedy output of this case's model reaches early for some prompts: the
    token the one-process reference emits 4th for prompt 0 (dp rank 0's prompts)."""
    args = dict(spec.get("args", {}))
    if args.get("eos_token_id") != "auto":
        return spec
    model = build_case(spec["model"]).eval()
    rows, ids, mask = prompts(100)
    ref = ours_reference(model, rows, ids.shape[1], {}) if spec["model"].startswith("ours") \
        else hf_reference(model, ids, mask, {})
    args["eos_token_id"] = int(ref[0, ids.shape[1] + 3])
    return {**spec, "args": args}


def main(which):
    import torch_monarch
    torch.set_num_threads(1)
    torch_monarch.init(timeout=180)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ["RANK"])
    names = list(CASES) if which == "all" else which.split(",")
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = run_case(name, resolve_eos(CASES[name]), rank)
        except Exception as e:  # noqa: BLE001 - every case is reported, the test asserts
            import traceback
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name]["case_seconds"] = time.perf_counter() - start
    torch.save(results, os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{rank}.pt"))
    return 0


if __name__ == "__main__":
    run_worker(main, sys.argv[1])
