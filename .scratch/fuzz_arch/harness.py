import os, sys, io, contextlib, warnings, traceback, time
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FXFUSE_CACHE_DIR", "/tmp/fxfuse_fuzz_arch_cache")
import torch
import fxfuse

def rel(a, b):
    a = a.double(); b = b.double()
    return ((a - b).norm() / (b.norm() + 1e-30)).item()

def compare(got, exp, path="out"):
    if isinstance(exp, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: got {type(got)}"]
        if got.shape != exp.shape or got.dtype != exp.dtype:
            return [f"{path}: got {got.dtype}{list(got.shape)} exp {exp.dtype}{list(exp.shape)}"]
        if not exp.is_floating_point():
            return [] if torch.equal(got, exp) else [f"{path}: int mismatch"]
        if not torch.equal(torch.isnan(got), torch.isnan(exp)):
            return [f"{path}: nan pattern"]
        e = rel(torch.nan_to_num(got), torch.nan_to_num(exp))
        tol = 1e-4 if exp.dtype == torch.float32 else 1e-2
        return [] if e <= tol else [f"{path}: rel err {e:.3e}"]
    if isinstance(exp, (tuple, list)):
        if type(got) != type(exp) or len(got) != len(exp):
            return [f"{path}: structure {type(got)} vs {type(exp)}"]
        r = []
        for i, (g, e) in enumerate(zip(got, exp)):
            r += compare(g, e, f"{path}[{i}]")
        return r
    if isinstance(exp, dict):
        if not isinstance(got, dict) or set(got) != set(exp):
            return [f"{path}: dict keys"]
        r = []
        for k in exp:
            r += compare(got[k], exp[k], f"{path}[{k!r}]")
        return r
    return [] if got == exp else [f"{path}: {got!r} vs {exp!r}"]

RESULTS = []

def check(name, model, make, batches=(3, 5), expect_fused=None, option_sets=None, linear=False, strict=False, quiet=False):
    """make(b) -> tuple of inputs."""
    model = model.eval()
    if option_sets is None:
        option_sets = [{}]
        if linear:
            option_sets += [dict(strassen="force"), dict(fused_mlp="force"), dict(gemm="force")]
    for opts in option_sets:
        tag = f"{name} {opts}"
        problems = []
        out = io.StringIO(); err = io.StringIO()
        t0 = time.time()
        with warnings.catch_warnings(record=True) as w, contextlib.redirect_stdout(out):
            warnings.simplefilter("always")
            try:
                torch.manual_seed(1)
                ex = make(batches[0])
                opt = fxfuse.optimize(model, ex if len(ex) > 1 else ex[0], strict=strict, **opts)
                is_opt = isinstance(opt, fxfuse.OptimizedModule)
                with torch.no_grad():
                    for b in list(batches) + [batches[0]]:
                        inp = make(b)
                        exp = model(*inp)
                        got = opt(*inp)
                        problems += [f"b={b}: {p}" for p in compare(got, exp)]
                st = fxfuse.stats(opt)
                ex_txt = fxfuse.explain(opt) if is_opt else ""
            except Exception as e:
                problems.append("EXC " + "".join(traceback.format_exception_only(type(e), e)).strip()[:600])
                st = {}; is_opt = False; ex_txt = ""
                tb = traceback.format_exc()
        msgs = [str(x.message) for x in w if "triton.runtime.interpreter" not in (x.filename or "")]
        msgs = [m for m in msgs if "numpy" not in m]
        if len(msgs) > 1:
            problems.append(f"{len(msgs)} warnings: " + " || ".join(m[:200] for m in msgs))
        elif msgs:
            problems.append("WARN: " + msgs[0][:400])
        if out.getvalue():
            problems.append("STDOUT: " + out.getvalue()[:300])
        if expect_fused and st.get("fused_kernels", 0) < expect_fused:
            problems.append(f"fused_kernels={st.get('fused_kernels')} < {expect_fused}")
        s = f"[{'OK ' if not problems else 'BAD'}] {tag} ({time.time()-t0:.1f}s) opt={is_opt} fused={st.get('fused_kernels')} lib={st.get('library_calls')} spec={st.get('specializations')} launches={st.get('kernel_launches')} reffb={st.get('reference_fallbacks')}"
        print(s, flush=True)
        for p in problems:
            print("     ", p, flush=True)
        if problems and any(p.startswith("EXC") for p in problems):
            print("      ", tb[-1500:])
        RESULTS.append((tag, problems, ex_txt))
    return RESULTS[-1]
