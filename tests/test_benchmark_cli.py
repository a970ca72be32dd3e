"""Usage errors of the benchmark and demo commands (fuzz36g: tracebacks, silently changed or
ignored values): each exits with status 2 and its reason, before anything runs."""
import re

import pytest
import torch

from benchmarks import autotune, blocks, conv, mlp
from fxfuse import demo


@pytest.mark.parametrize("main,argv,reason", [
    (mlp.main, ["--layers", "", "--quick"], "positive integers"),
    (mlp.main, ["--hidden", "-1", "--quick"], "positive integers"),
    (mlp.main, ["--device", "bogus", "--quick"], "no torch device"),
    (mlp.main, ["--reps", "2", "--quick"], "at least 5"),
    (mlp.main, ["--tools", ",", "--quick"], "--tools is empty"),
    (blocks.main, ["--cases", ""], "--cases is empty"),
    (conv.main, ["--cases", ",", "--quick"], "--cases is empty"),
    (demo.main, ["--batch", "0"], "positive integer"),
    (autotune.parse_args, [["--sections", "bogus"]], "unknown \\['bogus'\\]"),
    (autotune.parse_args, [["--m", "-1"]], "positive integers"),
])
def test_bad_values_are_usage_errors(main, argv, reason, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(*argv) if main is autotune.parse_args else main(argv)
    assert exit_.value.code == 2
    assert re.search(reason, capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
def test_device_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit) as exit_:
        mlp.main(["--device", "cuda", "--quick"])
    assert exit_.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_blocks_quick_picks_its_small_cases():
    assert set(blocks.QUICK) <= set(blocks.CASES)
