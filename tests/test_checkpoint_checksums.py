"""Checkpoints are verified on restore (`jaxppo.run.checkpoints`): a byte flipped at any of
many positions of any file of the newest checkpoint (data, metadata, orbax's markers, the
checksum file itself) is never restored silently: the run falls back to the previous
checkpoint, with a warning naming the one set aside. A checksum file missing where one was
due is a fallback too; a checkpoint from before checksums restores with a warning."""

import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.run import checkpoints as ck


def _tree(scale):
    return {"params": {"w": jnp.arange(24.0).reshape(4, 6) * scale, "b": jnp.full((6,), scale, jnp.bfloat16)},
            "step": jnp.int32(7 * scale), "key": jax.random.key_data(jax.random.key(int(scale)))}


def _restore(directory):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = ck.restore_latest(str(directory), _tree(1.0))
    return found, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("saved") / "checkpoints"
    ck.save(str(base), 1, _tree(1.0))
    ck.save(str(base), 2, _tree(2.0))
    return base


def test_a_saved_checkpoint_carries_its_checksums_and_restores(saved, tmp_path):
    assert sorted(ck.checksums(str(saved / "2"))) == sorted(
        os.path.relpath(os.path.join(r, n), saved / "2").replace(os.sep, "/")
        for r, _, names in os.walk(saved / "2") for n in names if n != ck.CHECKSUMS)
    assert ck.verify(str(saved / "2")) is True
    work = tmp_path / "checkpoints"
    shutil.copytree(saved, work)
    (step, tree), messages = _restore(work)
    assert step == 2 and _same(tree, _tree(2.0)) and not messages


def test_a_flipped_byte_anywhere_is_never_restored_silently(saved, tmp_path):
    files = sorted(os.path.relpath(os.path.join(r, n), saved / "2")
                   for r, _, names in os.walk(saved / "2") for n in names)
    assert ck.CHECKSUMS in files and len(files) >= 10  # data, metadata, markers and the checksums
    cases = 0
    for name in files:
        size = os.path.getsize(saved / "2" / name)
        for position in sorted({0, size // 3, size // 2, size - 1}):
            work = tmp_path / f"{cases}" / "checkpoints"
            shutil.copytree(saved, work)
            with open(work / "2" / name, "r+b") as f:
                f.seek(position)
                byte = f.read(1)[0]
                f.seek(position)
                f.write(bytes([byte ^ 0x10]))
            (step, tree), messages = _restore(work)
            assert step == 1 and _same(tree, _tree(1.0)), (name, position)  # the previous one, never a silent 2
            assert any(str(work / "2") in m for m in messages), (name, position, messages)
            assert os.path.isdir(str(work) + ".corrupt") and not (work / "2").exists()  # set aside
            cases += 1
    assert cases >= 50  # 14 files, 4 positions each


def test_a_missing_checksum_file_falls_back_and_an_old_checkpoint_restores_with_a_warning(saved, tmp_path):
    work = tmp_path / "missing" / "checkpoints"
    shutil.copytree(saved, work)
    os.remove(work / "2" / ck.CHECKSUMS)
    (step, _), messages = _restore(work)
    assert step == 1 and any("checksum file jaxppo_checksums.json is missing" in m for m in messages)

    import orbax.checkpoint as ocp  # a checkpoint as jaxppo 0.4 wrote it: no checksums, none announced

    old = tmp_path / "old" / "checkpoints"
    manager = ocp.CheckpointManager(str(old), options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
    manager.save(3, args=ocp.args.StandardSave(_tree(3.0)),
                 custom_metadata={"jaxppo_checkpoint_layout": ck.LAYOUT, "jaxppo_version": "0.4.0"})
    manager.wait_until_finished()
    manager.close()
    (step, tree), messages = _restore(old)
    assert step == 3 and _same(tree, _tree(3.0))
    assert any("written without checksums" in m and "restored unverified" in m for m in messages)


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def test_exported_policies_and_adapters_carry_checksums_checked_on_load(tmp_path):
    """An export (the policy, a PEFT adapter) carries the SHA-256 of its files; jaxppo loads
    it back unchanged, allows files added beside it, and refuses a copy with a flipped byte
    or a missing file, naming the folder and the file."""
    from jaxppo import demo
    from jaxppo.files import CHECKSUMS
    from jaxppo.models import LoraConfig, from_pretrained
    from jaxppo.models.adapters import add_lora
    from jaxppo.models.peft import load_peft_adapter
    from jaxppo.run.outputs import export_adapter, export_policy

    tokenizer = demo.demo_tokenizer()
    model, params = demo.demo_policy(tokenizer, width=32, layers=1)
    export_policy(model, params, tokenizer, str(tmp_path / "policy"))
    saved = ck.checksums(str(tmp_path / "policy"))
    assert (tmp_path / "policy" / CHECKSUMS).is_file() and "model.safetensors" in saved and "config.json" in saved
    (tmp_path / "policy" / "README.md").write_text("a model card added later\n")
    _, loaded = from_pretrained(str(tmp_path / "policy"))
    assert _same(loaded, params)
    _flip(tmp_path / "policy" / "model.safetensors", os.path.getsize(tmp_path / "policy" / "model.safetensors") // 2)
    with pytest.raises(ValueError, match=r"the checkpoint '.*policy' is damaged: file model.safetensors does not "
                                         r"match its checksum .* copy or export it again"):
        from_pretrained(str(tmp_path / "policy"))

    lora_model, variables = add_lora(model, params, LoraConfig(rank=2, alpha=4.0, targets=("c_attn",)), jax.random.key(1))
    variables = {**variables, "lora": jax.tree.map(lambda x: x + 0.01, variables["lora"])}
    export_adapter(lora_model, variables, str(tmp_path / "adapter"))
    _, back = load_peft_adapter(model, params, str(tmp_path / "adapter"))
    assert _same(back["lora"], variables["lora"])
    os.remove(tmp_path / "adapter" / "adapter_config.json")
    with pytest.raises(ValueError, match=r"the PEFT adapter '.*adapter' is damaged: file adapter_config.json is "
                                         r"missing"):
        load_peft_adapter(model, params, str(tmp_path / "adapter"))


def test_run_settings_carry_a_checksum_checked_when_a_run_opens(tmp_path):
    """run_settings.json holds the SHA-256 of the settings: a value changed in the file (a
    flipped bit that still parses) is refused with the file named, not taken for the run's
    settings; settings saved without one (jaxppo 0.4) are read as they are."""
    import json

    from jaxppo.errors import RunError
    from jaxppo.run.directory import SETTINGS_FILE, check_settings

    settings = {"ppo": {"batch_size": 16, "kl_coef": 0.05}, "trainer": {"learning_rate": 1e-3}}
    check_settings(str(tmp_path), settings)
    path = tmp_path / SETTINGS_FILE
    check_settings(str(tmp_path), settings)  # the same settings: accepted
    text = path.read_text()
    path.write_text(text.replace('"batch_size": 16', '"batch_size": 17'))
    with pytest.raises(RunError, match=r"run_settings.json does not match the checksum saved in it \(_sha256\)"):
        check_settings(str(tmp_path), {**settings, "ppo": {"batch_size": 17, "kl_coef": 0.05}})
    old = json.loads(text)
    del old["_sha256"]
    path.write_text(json.dumps(old))  # as jaxppo 0.4 wrote it
    check_settings(str(tmp_path), settings)
    with pytest.raises(RunError, match=r"(?s)holds a run with other settings.*batch_size: was 16, now 17"):
        check_settings(str(tmp_path), {**settings, "ppo": {"batch_size": 17, "kl_coef": 0.05}})
