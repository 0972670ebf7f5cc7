import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{name: (directory, torch model)} of tiny random Hugging Face checkpoints."""
    import hf_models

    root = tmp_path_factory.mktemp("hf")
    return {name: (str(root / name), hf_models.build(name, str(root / name))) for name in hf_models.NAMES}
