"""The seed network: Sequential of `layers` x (Linear(h, h), ReLU(inplace=True)), inference.

This is the network of the post that started the project (DESIGN.md, "Why it exists").
The grid spans the three regimes: launch-bound (small batch and width), cuBLAS far from peak
(middle), and FLOP-bound (large), where only Strassen goes below the classical floor.

    python -m benchmarks.mlp --layers 8 --hidden 1024 --batch 64
    python -m benchmarks.mlp --quick --tools eager,compile --out /tmp/benchout
    python -m benchmarks.mlp --residual --layers 8 --hidden 128 --batch 1024   # h = h + relu(lin(h))

Per cell: FLOPs = 2 * batch * h * h * layers (counted by FlopCounterMode, which gives exactly
this for addmm); minimum bytes = weights and biases read once + input + output. Activations
between layers are left out on purpose: a fully fused MLP need not write them, so the floor
stays a true lower bound.

Layers are distinct modules (`[Linear, ReLU] * layers` would repeat one Linear), in eval()
mode under no_grad, fp32 with TF32 off unless --dtype says otherwise.
"""
import torch
import torch.nn as nn

from . import common

GRID = {
    "layers": [1, 2, 4, 8],
    "hidden": [128, 256, 512, 1024, 2048, 4096, 8192],
    "batch": [1, 16, 64, 256, 1024, 4096],
}
QUICK = {"layers": [2], "hidden": [64], "batch": [4]}


def seed_mlp(layers, hidden):
    """`layers` distinct (Linear(hidden, hidden), ReLU(inplace=True)) pairs."""
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU(inplace=True)]
    return nn.Sequential(*mods)


def seed_cells(cells: str, layers: int, device: str = "cuda"):
    """(cell, model, inputs, ref) for each "BATCHxHIDDEN" of a comma list, as the probes use
    them: the seed network (seed 0), fp32 inputs rotated by common.make_inputs, and the float64
    answer on inputs[1]."""
    for cell in cells.split(","):
        batch, hidden = (int(v) for v in cell.split("x"))
        torch.manual_seed(0)
        model = seed_mlp(layers, hidden).to(device).eval()
        inputs = common.make_inputs((batch, hidden), torch.float32, torch.device(device))
        with torch.no_grad():
            ref = model.double()(inputs[1].double()).float()
        yield cell, model.float(), inputs, ref


class ResidualMLP(nn.Module):
    """`layers` x (h = h + relu(Linear(h))): the seed network with a ResMLP skip per layer
    (--residual), which reads each layer's input twice."""

    def __init__(self, layers, hidden):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, h):
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return h


def estimated_bytes(layers, hidden, batch):
    """GPU bytes a cell may need at its peak, to skip cells that cannot fit.

    The model, its float64 reference copy, fxfuse's private copy plus room for rewritten
    weights (Strassen keeps 7/4 per level), and a dozen activation-sized buffers (rotated
    inputs, CUDA-graph static buffers, the float64 reference output).
    """
    params = layers * (hidden * hidden + hidden)
    acts = batch * hidden

    def need(elt):
        return params * (4 * elt + 8) + acts * (12 * elt + 3 * 8)

    return need


def cases(layers, hidden, batch, residual=False):
    make = ResidualMLP if residual else seed_mlp
    extra = {"residual": True} if residual else {}
    out = []
    for n_layers in layers:
        for h in hidden:
            for b in batch:
                out.append(common.Case(
                    params={"layers": n_layers, "hidden": h, "batch": b, **extra},
                    make_model=lambda n_layers=n_layers, h=h: make(n_layers, h),
                    input_shape=(b, h),
                    est_bytes=estimated_bytes(n_layers, h, b),
                ))
    return out


def main(argv=None):
    parser = common.main_parser(__doc__.splitlines()[0])
    for key, values in GRID.items():
        parser.add_argument(f"--{key}", type=common.csv_ints,
                            help=f"comma list (default {','.join(map(str, values))})")
    parser.add_argument("--residual", action="store_true", help="h = h + relu(Linear(h)) per layer (ResMLP)")
    args = parser.parse_args(argv)
    grid = QUICK if args.quick else GRID
    chosen = {k: getattr(args, k) or grid[k] for k in GRID}
    common.run_benchmark("mlp_residual" if args.residual else "mlp", cases(**chosen, residual=args.residual), args,
                         heatmap_keys=("batch", "hidden", "layers"))


if __name__ == "__main__":
    main()
