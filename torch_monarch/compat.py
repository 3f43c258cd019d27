"""Differences between the torch versions the project runs on (Debian's 1.13 on Python 3.11,
torch 2.x on the GPU machine) live here and nowhere else in the Python package."""

import re

import torch


def torch_version():
    """(major, minor) of the installed torch."""
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return int(match.group(1)), int(match.group(2))


def torchrun_needs_fixes():
    """torch 1.x's torchrun: underscore-only flags and an elastic parser broken on Python 3.11."""
    return torch_version() < (2, 0)


def fix_elastic_std_parsing():
    """torch 1.13's ``Std.from_str`` looks its value up by iterating the ``IntFlag``; since
    Python 3.11 that iteration skips the zero member, so ``--redirects 0`` (the default)
    became None and torchrun died with "'NoneType' object has no attribute 'get'". The
    lookup is replaced by the enum's own constructor, which accepts every member."""
    from torch.distributed.elastic.multiprocessing import api

    std = api.Std
    if getattr(std.from_str, "_monarch_fixed", False):
        return

    def from_str(cls, value: str):
        value = value.strip()
        if re.fullmatch(r"[0-3]", value):
            return cls(int(value))
        if re.fullmatch(r"(\d+:[0-3],)*\d+:[0-3]", value):
            pairs = (item.split(":") for item in value.split(","))
            return {int(rank): cls(int(flag)) for rank, flag in pairs}
        raise ValueError(f"{value!r} is not a redirect / tee setting: expected 0-3, or rank:0-3 pairs "
                         "separated by commas (e.g. 0:3,1:0)")

    from_str._monarch_fixed = True
    std.from_str = classmethod(from_str)


def add_dashed_aliases(parser):
    """Lets an argparse parser whose long options are spelt with underscores (torch 1.x's
    torchrun: ``--nproc_per_node``) also accept torch 2.x's spelling (``--nproc-per-node``)."""
    for action in list(parser._actions):
        for option in list(action.option_strings):
            if option.startswith("--") and "_" in option:
                dashed = "--" + option[2:].replace("_", "-")
                if dashed not in parser._option_string_actions:
                    action.option_strings.append(dashed)
                    parser._option_string_actions[dashed] = action
    return parser


def functional_call(module, tensors, args, kwargs):
    """Runs ``module`` with its parameters and buffers replaced by ``tensors`` ({name: tensor},
    every alias of a shared tensor named), leaving the module itself untouched."""
    try:
        from torch.func import functional_call as call  # torch >= 2.0
    except ImportError:
        from torch.nn.utils.stateless import functional_call as call  # torch 1.13
    return call(module, tensors, args, kwargs)


def dispatch_mode_base():
    """The class a Python dispatch mode derives from (sees every aten op after autograd)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    return TorchDispatchMode


_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "linspace", "eye")


class meta_device:
    """Within it, tensors made without an explicit device are made on ``meta`` (no storage):
    a module of any size is built in no time and no memory. torch >= 2.0 has this as
    ``with torch.device("meta")``; torch 1.13 does not, so its factory functions are wrapped
    for the duration (module constructors create parameters through them)."""

    def __enter__(self):
        if torch_version() >= (2, 0):
            self._device = torch.device("meta")
            self._device.__enter__()
            return self
        self._saved = {}
        for name in _FACTORIES:
            original = getattr(torch, name)
            self._saved[name] = original

            def on_meta(*args, _original=original, **kwargs):
                if kwargs.get("device") is None:
                    kwargs["device"] = "meta"
                return _original(*args, **kwargs)

            setattr(torch, name, on_meta)
        return self

    def __exit__(self, *exc):
        if torch_version() >= (2, 0):
            return self._device.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch, name, original)
        return False


def forward_pre_hooks_take_kwargs():
    """torch >= 2.0 passes keyword arguments to forward pre-hooks (``with_kwargs=True``)."""
    import inspect

    from torch import nn
    return "with_kwargs" in inspect.signature(nn.Module.register_forward_pre_hook).parameters
