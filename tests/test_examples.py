"""The examples run and do what they say (small settings, same code paths)."""

import importlib.util
import pathlib

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_toy_train_step_learns_and_counts_updates():
    result = load("toy_train_step").main(["--iterations", "12", "--batch-size", "32", "--mini-batch-size", "8"])
    assert result["updates_per_step"] == 4 * 32 // 8
    assert result["step"] == 12 * result["updates_per_step"]
    # The score starts near chance (1/16 of tokens on target) and must clearly rise.
    assert result["last"] > result["first"] + 0.2, result
