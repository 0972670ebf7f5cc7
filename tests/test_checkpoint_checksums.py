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
