"""``python3 -m torch_monarch``: plans a model written in Python, without materializing it
(``plan``); writes a plan's HTML report (``report``); compares two plans (``diff``); merges a
hung or failed job's flight recorder dumps and names where the ranks diverged (``hangs``).

    python3 -m torch_monarch plan examples/models.py:gpt2_small --seq 1024 \\
        --gpus 64 --cluster a100-80gb --global-batch 512 -o plan.json

The model is ``FILE.py:FUNCTION`` (or ``package.module:FUNCTION``): a function (or class)
returning an ``nn.Module``, called under ``torch_monarch.meta_init()`` so that no weight is
allocated. The example input is a batch of one: token ids of ``--seq`` length, or a float
tensor of ``--input-shape`` (without the batch dimension). Pins use ``monarch-plan``'s
names. The summary goes to stdout, the plan to ``-o``; errors are one line on stderr and
exit status 1 (bad input) or 2 (bad usage).
"""

import argparse
import importlib
import importlib.util
import os
import sys


def _load_factory(spec):
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"model '{spec}': expected FILE.py:FUNCTION or package.module:FUNCTION")
    if path.endswith(".py") or os.sep in path:
        if not os.path.exists(path):
            raise ValueError(f"model '{spec}': no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"_monarch_model_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    factory = getattr(module, name, None)
    if factory is None or not callable(factory):
        raise ValueError(f"model '{spec}': {path} has no function or class '{name}'")
    return factory


def _parser():
    p = argparse.ArgumentParser(prog="python3 -m torch_monarch", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="read a Python model on the meta device and plan it")
    plan.add_argument("model", help="FILE.py:FUNCTION or package.module:FUNCTION returning an nn.Module")
    shape = plan.add_mutually_exclusive_group(required=True)
    shape.add_argument("--seq", type=int, help="the input is token ids of this sequence length")
    shape.add_argument("--input-shape", help="the input is a float tensor of this shape, e.g. 3,224,224")
    plan.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    plan.add_argument("--gpus", type=int, required=True, help="devices in the cluster")
    plan.add_argument("--cluster", default="a100-80gb", help="preset (see monarch-plan presets)")
    plan.add_argument("--dtype", default="bf16", help="compute dtype: bf16, fp16, fp32")
    plan.add_argument("-o", "--output", help="write the plan JSON here")
    for name in ("tp", "pp", "dp", "zero", "micro-batch", "virtual-stages"):
        plan.add_argument(f"--{name}", type=int)
    plan.add_argument("--schedule")
    plan.add_argument("--sequence-parallel", choices=["on", "off"])
    report = sub.add_parser("report", help="write a plan as one self-contained HTML page")
    report.add_argument("plan", help="plan JSON")
    report.add_argument("-o", "--output", required=True, help="the HTML file to write")
    report.add_argument("--trace", help="a run's measured trace (model.trace()), drawn under the prediction")
    report.add_argument("--trace-step", type=int, default=-1, help="which pipeline step of the trace (default: last)")
    hangs = sub.add_parser("hangs", help="merge the ranks' flight recorder dumps and name the first divergence")
    hangs.add_argument("directory", help="MONARCH_FLIGHT_RECORDER_DIR of the job")
    diff = sub.add_parser("diff", help="what differs between two plans")
    diff.add_argument("a", help="plan JSON")
    diff.add_argument("b", help="plan JSON")
    return p


def _report_or_diff(args):
    from . import planner as _planner
    if args.command == "report":
        plan = _planner.load(args.plan)
        plan.report(args.output, trace=args.trace, trace_step=args.trace_step)
        print(f"wrote {args.output}")
    else:
        print(f"--- {args.a}\n+++ {args.b}")
        print(_planner.diff(_planner.load(args.a), _planner.load(args.b)), end="")
    return 0


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.command == "hangs":
        from . import hangs
        try:
            print(hangs.report(args.directory))
        except ValueError as e:
            print(f"python3 -m torch_monarch: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command in ("report", "diff"):
        try:
            return _report_or_diff(args)
        except (ValueError, RuntimeError, OSError) as e:
            print(f"python3 -m torch_monarch: {e}", file=sys.stderr)
            return 1
    try:
        import torch

        from . import api, compat
        from . import planner as _planner
        factory = _load_factory(args.model)
        with compat.meta_device():
            model = factory()
        if args.seq is not None:
            example = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
        else:
            dims = [int(d) for d in args.input_shape.split(",")]
            example = torch.zeros(1, *dims, device="meta")
        pins = {"tp": args.tp, "pp": args.pp, "dp": args.dp, "zero": args.zero, "micro_batch": args.micro_batch,
                "virtual_stages": args.virtual_stages, "schedule": args.schedule,
                "sequence_parallel": None if args.sequence_parallel is None else args.sequence_parallel == "on"}
        pins = {k: v for k, v in pins.items() if v is not None}
        name = args.model.rpartition(":")[2]
        plan = api.plan(model, example, args.global_batch, _planner.cluster(args.cluster, args.gpus),
                        dtype=args.dtype, name=name, **pins)
    except (ValueError, TypeError, RuntimeError, ImportError) as e:
        print(f"python3 -m torch_monarch: {e}", file=sys.stderr)
        return 1
    print(plan.report())
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
