"""Convolution cases at batch 1, and the classic MNIST CNN at batch 1 and 64.

Why these: each pair has the same input and output shapes, and the factorized ("low-rank")
variant does a fraction of the FLOPs of the full convolution, yet in eager it is often not
faster, because it is more launches and more memory passes. A graph compiler should turn the
FLOP savings into time savings; the MNIST CNN mixes convolutions, pooling, a large Linear
and a log_softmax, all tiny at batch 1.

    python -m benchmarks.conv
    python -m benchmarks.conv --cases mnist --batch 1,64
    python -m benchmarks.conv --quick --tools eager --out /tmp/benchout

FLOPs are counted by FlopCounterMode (convolutions and matmuls; pointwise work, pooling and
softmax are not counted). Minimum bytes = parameters read once + input + output; the
intermediates between layers are left out, since fusion may keep them on chip.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import common


class MnistNet(nn.Module):
    """The PyTorch examples MNIST network (eval mode: dropout is the identity)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


# name -> (factory, input channels, what it is compared with)
CONVS = {
    "conv3x3": (lambda: nn.Conv2d(64, 64, 3, padding=1), 64, "full 3x3, 64->64"),
    "lowrank3x3": (lambda: nn.Sequential(nn.Conv2d(64, 14, 1), nn.Conv2d(14, 15, 3, padding=1),
                                         nn.Conv2d(15, 64, 1)), 64,
                   "1x1 64->14, 3x3 14->15, 1x1 15->64 (vs conv3x3)"),
    "conv1x1": (lambda: nn.Conv2d(256, 128, 1), 256, "full 1x1, 256->128"),
    "lowrank1x1": (lambda: nn.Sequential(nn.Conv2d(256, 1, 1), nn.Conv2d(1, 128, 1)), 256,
                   "1x1 256->1, 1x1 1->128 (vs conv1x1)"),
}
CASES = list(CONVS) + ["mnist"]
SPATIAL = (160, 120)
QUICK_SPATIAL = (20, 15)
MNIST_BATCH = [1, 64]


def cases(names, spatial, mnist_batch):
    out = []
    for name in names:
        if name == "mnist":
            for b in mnist_batch:
                out.append(common.Case(
                    params={"case": "mnist", "batch": b, "input": "1x28x28"},
                    make_model=MnistNet, input_shape=(b, 1, 28, 28)))
            continue
        factory, channels, what = CONVS[name]
        out.append(common.Case(
            params={"case": name, "batch": 1, "input": f"{channels}x{spatial[0]}x{spatial[1]}"},
            make_model=factory, input_shape=(1, channels, *spatial), notes=[what]))
    return out


def main(argv=None):
    parser = common.main_parser(__doc__.splitlines()[0])
    parser.add_argument("--cases", help=f"comma list of {','.join(CASES)} (default: all)")
    parser.add_argument("--batch", type=common.csv_ints,
                        help="batch sizes of the MNIST CNN (default 1,64; --quick: 1)")
    args = parser.parse_args(argv)
    if args.cases is not None and not args.cases.strip(","):
        parser.error("--cases is empty")
    names = [n.strip() for n in args.cases.split(",") if n.strip()] if args.cases else CASES
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    spatial = QUICK_SPATIAL if args.quick else SPATIAL
    batch = args.batch or ([1] if args.quick else MNIST_BATCH)
    common.run_benchmark("conv", cases(names, spatial, batch), args)


if __name__ == "__main__":
    main()
