"""Compile a fused-MLP kernel for a GPU target without a GPU; print its registers and stack (spills).

    TRITON_INTERPRET=0 python -m benchmarks.offline_compile --layers 8 --width 128 --rows 16 --tile 32 --warps 4

Why: the fp32 tl.dot ("ieee") form of the fused MLP measured 429-474 us at width 128 where the
row-wise form takes ~10 us (mlp_spec.choose_config), and device time is scarce. ptxas's resource
usage says why without a GPU: registers per thread and the stack a thread spills to. `--rows` 1
is the row-wise form at one row per program, 16 and up the tl.dot form (2-8: a multi-row row-wise
form, measured on the H100 at 2.4-6x slower than the per-layer plan and removed; see
offline_compile_20261125.txt). Uses the ptxas and cuobjdump that ship with the installed Triton.
"""
import argparse
import importlib.util
import os
import subprocess
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from fxfuse.mlp_codegen import generate_mlp
from fxfuse.mlp_spec import KernelConfig, Linear, MLPSpec, Pointwise

SIGNATURE = {"x_ptr": "*fp32", "out_ptr": "*fp32", "w_ptr": "*fp32", "v_ptr": "*fp32", "M": "i32",
             "stride_xm": "i32", "stride_om": "i32", "BLOCK_M": "constexpr"}


def seed_spec(width: int, layers: int) -> MLPSpec:
    """8 x (Linear(w, w) + bias, ReLU) as passes/fuse_mlp.py describes the seed network."""
    widths, steps = [width], []
    for k in range(layers):
        v = len(widths)
        steps += [Linear(v, v - 1, k), Pointwise(v + 1, "add", (("value", v), ("vector", k))),
                  Pointwise(v + 2, "relu", (("value", v + 1),))]
        widths += [width] * 3
    return MLPSpec(tuple(widths), tuple(steps), len(widths) - 1, torch.float32)


def compile_kernel(spec: MLPSpec, config: KernelConfig, arch: int = 90):
    source, name = generate_mlp(spec, tuple([spec.widths[1]] * len(spec.linears)), config)
    path = os.path.join(tempfile.mkdtemp(), name + ".py")
    with open(path, "w") as f:
        f.write(source)
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return triton.compile(ASTSource(getattr(module, name), SIGNATURE, constexprs={"BLOCK_M": config.block_m}),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": config.num_warps})


def resource_usage(kernel) -> str:
    cubin = os.path.join(tempfile.mkdtemp(), "k.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
    return " ".join(part for line in out.splitlines() if "REG" in line
                    for part in line.split() if part.split(":")[0] in ("REG", "STACK", "SHARED"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--rows", type=int, default=16, help="rows per program (1 row-wise, >= 16 tl.dot)")
    ap.add_argument("--tile", type=int, default=32, help="lanes per column tile (KernelConfig.max_tile)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("set TRITON_INTERPRET=0: the interpreter compiles nothing")
    if 1 < args.rows < 16:
        raise SystemExit("--rows: 1 (row-wise) or >= 16 (tl.dot); the multi-row row-wise form was removed")
    config = KernelConfig(block_m=args.rows, rowwise=args.rows < 16, max_tile=args.tile, num_warps=args.warps)
    start = time.perf_counter()
    kernel = compile_kernel(seed_spec(args.width, args.layers), config, args.arch)
    print(f"{args.layers} x {args.width}, sm_{args.arch}, {config}: {resource_usage(kernel)} "
          f"(triton {triton.__version__}, {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
