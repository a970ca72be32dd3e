"""What fxfuse hooks into torch to see changes that no version counter or module registration
reports: torch.func.functional_call's tensor swaps, and fused optimizer steps.

Both are process-wide and installed once, on import. runtime.OptimizedModule reads the counts per
call (one integer compare each while nothing happens).
"""
import contextlib

import torch

REPARAMETRIZING = [0, []]   # functional_call swaps in progress (any thread): (module, names of the swapped tensors)


def _counting_swaps(reparametrize):
    """torch.func.functional_call swaps a module's tensors by writing its _parameters/_buffers
    dicts, which no registration hook sees: a build then baked the temporary tensors in, and a
    CUDA graph replays the registered ones (fuzz33e, review33). While a swap is in progress, an
    optimized module on the path to a swapped tensor runs its original; other models, in any
    thread, run on (review33b)."""
    @contextlib.contextmanager
    def swapped(*args, **kwargs):
        entry = (args[0] if args else kwargs.get("module"),
                 tuple(args[1] if len(args) > 1 else kwargs.get("parameters_and_buffers", {})))
        REPARAMETRIZING[1].append(entry)   # O(1) here: the paths are walked only when an optimized
        REPARAMETRIZING[0] += 1            # module is called meanwhile (fuzz33n: 12-96 us per call otherwise)
        try:
            with reparametrize(*args, **kwargs):
                yield
        finally:
            REPARAMETRIZING[0] -= 1
            try:
                REPARAMETRIZING[1].remove(entry)
            except ValueError:
                pass
    swapped.fxfuse_counts_swaps = True
    return swapped


def swapped_now(*modules) -> bool:
    """Whether a functional_call in progress swaps a tensor under one of `modules` (by identity)."""
    wanted = {id(m) for m in modules}
    return any(_on_paths(root, names) & wanted for root, names in list(REPARAMETRIZING[1])
               if isinstance(root, torch.nn.Module))


def _on_paths(root, names) -> set:
    """ids of the modules from root down to each swapped tensor's owner (`block.original.lin.weight`:
    root, block, block.original, block.original.lin). An optimized module elsewhere under root
    (functional_call of a parent swapping only its head) runs on (fuzz33l)."""
    ids = {id(root)}
    for name in names:
        module = root
        for part in str(name).split(".")[:-1]:
            module = module._modules.get(part) if isinstance(module, torch.nn.Module) else None
            if module is None:
                break
            ids.add(id(module))
    return ids


_stateless = getattr(getattr(torch.nn, "utils", None), "stateless", None)
if _stateless is not None and hasattr(_stateless, "_reparametrize_module") \
        and not getattr(_stateless._reparametrize_module, "fxfuse_counts_swaps", False):   # once per process
    _stateless._reparametrize_module = _counting_swaps(_stateless._reparametrize_module)


UNVERSIONED_STEPS = [0, {}]   # fused optimizer steps in this process; id of each parameter -> the step that last wrote it


def _count_fused_step(optimizer, args, kwargs) -> None:
    """torch's fused optimizers (`Adam(fused=True)`, SGD, AdamW, Adagrad) write parameters in
    one kernel that bumps no version counter (fuzz33a), so a copy made from a parameter (a
    folded BatchNorm, a packed weight) would stay stale: a count the runtime compares per call,
    and for each parameter the step that last wrote it (a model whose parameters another
    optimizer steps need not rebuild: fuzz33l)."""
    groups = [g for g in getattr(optimizer, "param_groups", ()) if g.get("fused")]
    if groups:
        UNVERSIONED_STEPS[0] += 1
        UNVERSIONED_STEPS[1].update((id(p), UNVERSIONED_STEPS[0]) for g in groups for p in g["params"])


try:
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_count_fused_step)
except ImportError:   # pragma: no cover -- torch < 2.0
    pass


SWAPPED = ("torch.func.functional_call (torch.nn.utils.stateless) swaps the model's tensors for others without "
           "the registrations fxfuse watches: the optimized graph would read the wrong ones")   # fuzz33e, review33b
