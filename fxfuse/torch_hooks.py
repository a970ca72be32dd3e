"""What fxfuse hooks into torch to see changes that no version counter or module registration
reports: torch.func.functional_call's and torch.utils.swap_tensors' tensor swaps, fused optimizer
steps, training flags set by train()/eval(), and parameters set to None.

Both are process-wide and installed once, on import. runtime.OptimizedModule reads the counts per
call (one integer compare each while nothing happens).
"""
import contextlib
import functools
import weakref

import torch

from .module_state import REGISTRATIONS

REPARAMETRIZING = [0, []]   # functional_call swaps in progress (any thread), and a [module] entry for each
REPARAMETRIZED = [0]        # functional_call swaps begun, in this process (tracing: one inside forward())
OPTIMIZED = weakref.WeakSet()   # the process's live OptimizedModules (runtime adds each)


def _counting_swaps(reparametrize):
    """torch.func.functional_call swaps a module's tensors by writing its _parameters/_buffers
    dicts, which no registration hook sees: a build then baked the temporary tensors in, and a
    CUDA graph replays the registered ones (fuzz33e, review33). While a swap is in progress, an
    optimized module anywhere under the swapped module runs its original (a tied or shared
    tensor is swapped under every name it has: review33c); other models, in any thread, run on
    (review33b)."""
    @contextlib.contextmanager
    def swapped(*args, **kwargs):
        if len(args) >= 2:
            args = (args[0], _through_original(args[0], args[1]), *args[2:])
        entry = [args[0] if args else kwargs.get("module")]   # a list: removed by identity, not ==
        REPARAMETRIZING[1].append(entry)   # O(1) here: the modules are walked only when an optimized
        REPARAMETRIZING[0] += 1            # module is called meanwhile (fuzz33n: 12-96 us per call otherwise)
        REPARAMETRIZED[0] += 1
        try:
            with reparametrize(*args, **kwargs):
                yield
        finally:
            REPARAMETRIZING[0] -= 1
            REGISTRATIONS[0] += 1   # the next call compares what each model holds: torch may leave a swapped
            active = REPARAMETRIZING[1]   # tensor behind (a module shared under two names, review33c)
            for k in range(len(active) - 1, -1, -1):
                if active[k] is entry:
                    del active[k]
                    break
    swapped.fxfuse_counts_swaps = True
    return swapped


def _through_original(module, tensors):
    """functional_call's tensors by the names torch knows: `opt.state_dict()` names a weight
    `l1.weight` (opt answers `opt.l1` through delegation) where torch's names are
    `original.l1.weight`. Given as they came, strict=True refused opt's own state_dict, a tied
    weight (embedding and head) was swapped under one of its names only, and a weight given under
    both names was left swapped for good (fuzz46c). A key that names a tensor as state_dict() does
    (every optimized module's `original.` left out, at any depth; the model's own submodule named
    `original` kept: review46r) is renamed to torch's name; a tensor given both ways is taken once,
    under torch's name."""
    from .runtime import OptimizedModule   # (runtime imports this module)
    if not OPTIMIZED or not isinstance(module, torch.nn.Module) or not isinstance(tensors, dict) or not any(
            isinstance(m, OptimizedModule) for m in module.modules()):   # (a swap costs O(1) without fxfuse)
        return tensors
    torch_names = [name for name, _ in module.named_parameters(remove_duplicate=False)] + \
        [name for name, _ in module.named_buffers(remove_duplicate=False)]
    as_saved = {_saved_name(module, name, OptimizedModule): name for name in torch_names}
    renamed = {}
    for key, value in tensors.items():
        name = as_saved.get(key, key)
        if name == key or name not in renamed:   # (one given under torch's own name wins)
            renamed[name] = value
    return renamed


def _saved_name(root, name: str, wrapper) -> str:
    """A parameter's or buffer's torch name as state_dict() gives it: each `original` segment
    that follows an optimized module (`wrapper`) left out."""
    parts, kept, m = name.split("."), [], root
    for part in parts[:-1]:
        if isinstance(m, wrapper) and part == "original":
            m = m._modules.get("original")
            continue
        kept.append(part)
        m = getattr(m, "_modules", {}).get(part)
    return ".".join(kept + parts[-1:])


def swapped_now(*modules) -> bool:
    """Whether a functional_call in progress swaps tensors of a module that holds one of `modules`."""
    wanted = {id(m) for m in modules}
    return any(isinstance(root, torch.nn.Module) and any(id(m) in wanted for m in root.modules())
               for root, in list(REPARAMETRIZING[1]))


_stateless = getattr(getattr(torch.nn, "utils", None), "stateless", None)
if _stateless is not None and hasattr(_stateless, "_reparametrize_module") \
        and not getattr(_stateless._reparametrize_module, "fxfuse_counts_swaps", False):   # once per process
    _stateless._reparametrize_module = _counting_swaps(_stateless._reparametrize_module)


def _counting_tensor_swaps(swap):
    """torch.utils.swap_tensors (nn.Module's conversions and load_state_dict under
    torch.__future__.set_swap_module_params_on_conversion(True), or the user's own call) gives a
    parameter another storage under the same Python object: no registration, no version move.
    The next call of every optimized module compares what its model holds (the storages too), so
    a generated GEMM's alias of the old weight, or a copy folded from it, is rebuilt (fuzz41c)."""
    @functools.wraps(swap)
    def swapped(t1, t2):
        try:
            return swap(t1, t2)
        finally:
            REGISTRATIONS[0] += 1
    swapped.fxfuse_counts_swaps = True
    return swapped


if hasattr(torch.utils, "swap_tensors") and not getattr(torch.utils.swap_tensors, "fxfuse_counts_swaps", False):
    torch.utils.swap_tensors = _counting_tensor_swaps(torch.utils.swap_tensors)


MODE_CHANGES = [0]   # train()/eval() calls that changed a module's training flag, in this process


def _counting_mode_changes(train):
    """nn.Module.train (eval() calls it), wrapped to count the calls that change a flag: forward()
    may read the flag of a child whose own forward ignores it (`if self.backbone.training`,
    `training=self.head.training`: fuzz34h), and the runtime then compares the flags it built
    with (one integer compare per call otherwise; a model.eval() that changes nothing counts
    nothing: fuzz34i measured a structure walk per call after each one)."""
    def train_counted(self, mode=True):
        changed = getattr(self, "training", mode) != mode
        try:
            return train(self, mode)
        finally:
            MODE_CHANGES[0] += changed
    train_counted = functools.wraps(train)(train_counted)   # train's name, docstring and signature
    train_counted.fxfuse_counts = True
    return train_counted


def _counting_removals(method, removes):
    """register_parameter and __delattr__, wrapped to move REGISTRATIONS where torch calls no
    registration hook: a parameter set to None (`bn.weight = None`) or a parameter, buffer or
    submodule deleted (`del lin.bias`), after which a graph went on using a copy folded from
    the old tensor (fuzz34h). Other calls count nothing."""
    def counted(self, name, *args, **kwargs):
        counts = removes(self, name, *args, **kwargs)
        try:
            return method(self, name, *args, **kwargs)
        finally:
            REGISTRATIONS[0] += counts
    counted = functools.wraps(method)(counted)
    counted.fxfuse_counts = True
    return counted


def _registered(module, name) -> bool:
    d = module.__dict__
    return any(name in d.get(k, ()) for k in ("_parameters", "_buffers", "_modules"))


if not getattr(torch.nn.Module.train, "fxfuse_counts", False):   # once per process
    torch.nn.Module.train = _counting_mode_changes(torch.nn.Module.train)
    torch.nn.Module.register_parameter = _counting_removals(
        torch.nn.Module.register_parameter, lambda m, name, param=None, *a, **k: param is None)
    torch.nn.Module.__delattr__ = _counting_removals(torch.nn.Module.__delattr__, _registered)


UNVERSIONED_STEPS = [0, {}]   # fused optimizer steps in this process; id of each parameter -> the step that last wrote it


def _count_fused_step(optimizer, args, kwargs) -> None:
    """torch's fused optimizers (`Adam(fused=True)`, SGD, AdamW, Adagrad) write parameters in
    one kernel that bumps no version counter (fuzz33a), so a copy made from a parameter (a
    folded BatchNorm, a packed weight) would stay stale: a count the runtime compares per call,
    and for each parameter the step that last wrote it (a model whose parameters another
    optimizer steps need not rebuild: fuzz33l). Counted before the step and after it: the
    optimizer's own post hooks run before the global ones, and may call the model (review33c);
    the parameters are marked before the count moves, so a reader that sees it sees them."""
    groups = [g for g in getattr(optimizer, "param_groups", ()) if g.get("fused")]
    if groups:
        _mark_unversioned([p for g in groups for p in g["params"]])


def _mark_unversioned(params) -> None:
    step = UNVERSIONED_STEPS[0] + 1
    UNVERSIONED_STEPS[1].update((id(p), step) for p in params)
    UNVERSIONED_STEPS[0] = step


def _marking_fused_writes(kernel):
    """torch's fused step kernel itself (`torch._fused_adam_`), which torch.optim's functional API
    (`torch.optim.adam.adam(..., fused=True)`), DDP's functional optimizers and optimizers of one's own
    call without a "fused" param group (fuzz50e: a folded BatchNorm stayed stale): the parameters
    it is given are marked, before and after, as the step hooks mark them."""
    @functools.wraps(kernel)
    def step(params, *args, **kwargs):
        marks = not torch.compiler.is_compiling() and isinstance(params, (list, tuple))
        if marks:
            _mark_unversioned(params)
        try:
            return kernel(params, *args, **kwargs)
        finally:
            if marks:
                _mark_unversioned(params)
    step.fxfuse_marks = True
    return step


for _name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
    if getattr(torch, _name, None) is not None and not getattr(getattr(torch, _name), "fxfuse_marks", False):
        setattr(torch, _name, _marking_fused_writes(getattr(torch, _name)))


try:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: _count_fused_step(optimizer, args, kwargs))
    register_optimizer_step_post_hook(_count_fused_step)
except ImportError:   # pragma: no cover -- torch < 2.0
    pass


PARAMETRIZE_CACHED = ("torch.nn.utils.parametrize.cached() is on: eager computes each parametrized weight once and "
                      "reuses it, the optimized graph would compute it at every read")

SWAPPED = ("torch.func.functional_call (torch.nn.utils.stateless) swaps the model's tensors for others without "
           "the registrations fxfuse watches: the optimized graph would read the wrong ones")   # fuzz33e, review33b
