"""What fxfuse hooks into torch to see changes that no version counter or module registration
reports: torch.func.functional_call's tensor swaps, and fused optimizer steps.

Both are process-wide and installed once, on import. runtime.OptimizedModule reads the counts per
call (one integer compare each while nothing happens).
"""
import contextlib

import torch

REPARAMETRIZING = [0, {}]   # functional_call swaps in progress (any thread); id of each module they touch -> count


def _counting_swaps(reparametrize):
    """torch.func.functional_call swaps a module's tensors by writing its _parameters/_buffers
    dicts, which no registration hook sees: a build then baked the temporary tensors in, and a
    CUDA graph replays the registered ones (fuzz33e, review33). While a swap of a module is in
    progress, the runtime of an optimized module among its modules runs the original; other
    models, in any thread, run on (review33b)."""
    @contextlib.contextmanager
    def swapped(*args, **kwargs):
        module = args[0] if args else kwargs.get("module")
        ids = [id(m) for m in module.modules()] if isinstance(module, torch.nn.Module) else []
        touched = REPARAMETRIZING[1]
        REPARAMETRIZING[0] += 1
        for i in ids:
            touched[i] = touched.get(i, 0) + 1
        try:
            with reparametrize(*args, **kwargs):
                yield
        finally:
            for i in ids:
                left = touched.get(i, 1) - 1
                if left:
                    touched[i] = left
                else:
                    touched.pop(i, None)
            REPARAMETRIZING[0] -= 1
    swapped.fxfuse_counts_swaps = True
    return swapped


_stateless = getattr(getattr(torch.nn, "utils", None), "stateless", None)
if _stateless is not None and hasattr(_stateless, "_reparametrize_module") \
        and not getattr(_stateless._reparametrize_module, "fxfuse_counts_swaps", False):   # once per process
    _stateless._reparametrize_module = _counting_swaps(_stateless._reparametrize_module)


UNVERSIONED_STEPS = [0, set()]   # fused optimizer steps in this process, ids of the parameters they wrote


def _count_fused_step(optimizer, args, kwargs) -> None:
    """torch's fused optimizers (`Adam(fused=True)`, SGD, AdamW, Adagrad) write parameters in
    one kernel that bumps no version counter (fuzz33a), so a copy made from a parameter (a
    folded BatchNorm, a packed weight) would stay stale: the ids of what they wrote, and a
    count the runtime compares per call."""
    groups = [g for g in getattr(optimizer, "param_groups", ()) if g.get("fused")]
    if groups:
        UNVERSIONED_STEPS[0] += 1
        UNVERSIONED_STEPS[1].update(id(p) for g in groups for p in g["params"])


try:
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_count_fused_step)
except ImportError:   # pragma: no cover -- torch < 2.0
    pass


SWAPPED = ("torch.func.functional_call (torch.nn.utils.stateless) swaps the model's tensors for others without "
           "the registrations fxfuse watches: the optimized graph would read the wrong ones")   # fuzz33e, review33b
