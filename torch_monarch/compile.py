"""``parallelize(..., compile=True)``: each block compiled by ``torch.compile`` (Inductor by
default), inside the layout's wrappers, as torchtitan compiles each transformer block under
FSDP2 (torchtitan ``apply_compile``; PyTorch's "Compiling FSDP2" notes).

Per block, and only the block's own ``forward``: the block's module hooks (ZeRO's gather
before and free after, the pipeline's stage cut, mixed precision's casts on the stage)
stay eager around the compiled code, so they never break its graph, and identical blocks
share one compiled graph (Dynamo treats module attributes as graph inputs, not constants).
What runs inside a block must trace: tensor parallelism's collectives do
(``tp_collectives.py`` gives Dynamo an operator for each), as do the sequence-parallel
gathers and gradient sums on modules inside blocks. Activation recomputation (``full``)
wraps the compiled forward, so the recomputed forward is the compiled one too.

Refused, by name, where something inside the blocks runs eagerly by design:
  * the zero-bubble schedule's deferred weight gradients (its linears' backward queues
    work for the executor's W pass from C++);
  * ``recompute="selective"`` (it finds the attention core by watching the block's aten
    ops as they run eagerly).
"""

import torch

_OPTIONS = {"backend", "mode", "fullgraph", "dynamic", "options"}


def compile_options(compile):
    """``compile=`` as given to parallelize (False/None, True, or a dict of
    ``torch.compile`` keywords) -> keywords, or None for no compilation."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, dict):
        unknown = sorted(set(compile) - _OPTIONS)
        if unknown:
            raise ValueError(f"parallelize: compile= keywords {unknown} are not torch.compile's "
                             f"(accepted: {sorted(_OPTIONS)})")
        return dict(compile)
    raise ValueError(f"parallelize: compile={compile!r} must be True, False or a dict of torch.compile keywords")


def check(options, zero_bubble, recompute):
    """Refuses what cannot run inside a compiled block, naming it. ``zero_bubble``: the name of
    the zero-bubble schedule the pipeline runs (zero_bubble_h1, zero_bubble_v), else None;
    ``recompute``: the recomputation mode's name."""
    if options is None:
        return
    if zero_bubble:
        raise ValueError(f"parallelize: compile=True with schedule {zero_bubble}: the zero-bubble schedule's "
                         "linears defer their weight gradients from C++ inside the blocks, which torch.compile "
                         "cannot trace; use schedule='1f1b' or 'interleaved_1f1b', or compile=False")
    if recompute == "selective":
        raise ValueError("parallelize: compile=True with recompute='selective': selective recomputation finds the "
                         "attention core by watching each block's operators run eagerly; use recompute='full' "
                         "or 'none' with compile=True")


def compile_blocks(model, blocks, options):
    """Compiles each block's own forward (not its hooks); returns how many it compiled.
    A block compiled already is left as it is. A Hugging Face model's key/value cache is
    turned off (``config.use_cache = False``): training reads none of it, and the cache's
    per-layer state (``layers[i].is_initialized``, read with the block's own ``layer_idx``)
    would make Dynamo compile every block anew, falling back to eager past its recompile
    limit (8)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    count = 0
    for block in blocks:
        if getattr(block, "_monarch_compiled", False):
            continue
        block.forward = torch.compile(block.forward, **options)
        block._monarch_compiled = True
        count += 1
    return count
