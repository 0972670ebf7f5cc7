"""A run's programs compiled for an NVIDIA GPU and a TPU topology without the hardware
(`jaxppo.plan`), pinning what only the target's compiler shows. Needs the extras
`jaxppo[plan-gpu,plan-tpu]`; CI's plan stage installs them and sets JAXPPO_REQUIRE_PLAN=1,
under which a missing compiler fails instead of skipping."""

import os
import re

import jax
import pytest
import transformers

import jaxppo
from jaxppo.cli import main as cli_main
from jaxppo.plan import plan_run, resolve_target
from jaxppo.plan.programs import abstract_run, lower_programs
from jaxppo.plan.targets import compiler_installed, target_devices
from jaxppo.run.parts import Inputs


HAVE = {"h200": compiler_installed("cuda"), "v5e-4": compiler_installed("tpu")}
TARGETS = [pytest.param(name, marks=pytest.mark.skipif(
    not have and not os.environ.get("JAXPPO_REQUIRE_PLAN"),
    reason=f"the compiler for {name} is not installed (pip install 'jaxppo[plan-gpu,plan-tpu]')"))
    for name, have in HAVE.items()]

LAYERS = 2


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("config_only")
    transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             eos_token_id=2, architectures=["LlamaForCausalLM"]).save_pretrained(d)
    return str(d)


def _config(**kw):
    settings = dict(batch_size=16, mini_batch_size=8, ppo_epochs=1, response_length=16, query_length=16,
                    dtype="bfloat16", remat=True)
    return jaxppo.Config.for_algorithm("ppo", **{**settings, **kw})


def _inputs(path):
    return Inputs(policy=path, tokenizer=None, prompts=None)


@pytest.mark.parametrize("name", TARGETS)
def test_the_run_compiles_for_the_target_with_its_custom_backward_and_a_bounded_decode_step(config_dir, name):
    target = resolve_target(name)
    plan = plan_run(_config(), _inputs(config_dir), target)
    programs = {p.name: p for p in plan.programs}
    assert set(programs) == {"update", "score", "generate"} and plan.fits
    assert all(p.memory.arguments > 0 for p in plan.programs)
    # The gated MLP's own backward pass and its optimisation barriers are in what compiled.
    shapes = abstract_run(_config(), _inputs(config_dir), target_devices(target))
    assert "optimization_barrier" in lower_programs(shapes, ("update",))["update"].as_text()
    # One decode step of a 2-layer model: a few dozen kernels per layer at most (measured:
    # 79 on one H200, about 300 with the collectives of 4 TPU chips); a regression that
    # splits the step into many more (a host round trip, unfused cache updates) fails.
    kernels = programs["generate"].decode_kernels
    assert 0 < kernels <= (60 if target.chips == 1 else 200) * LAYERS, kernels


@pytest.mark.parametrize("name", TARGETS)
def test_the_updates_temporaries_follow_the_mini_batch_and_hold_no_second_state(tmp_path, name):
    """Under the target's compiler the update's temporaries grow with the mini-batch, and
    what does not grow with it (their straight line's value at zero rows) stays within the
    bound of a full fine-tuning update: the sharded float32 gradients plus two layers of
    weights gathered in the compute dtype. The breakdown finds no copy of the training
    state. Before the withheld update became a per-leaf select on GPU and TPU targets, the
    H200's temporaries were 912 and 1185 MiB at 4 and 16 rows: a 0.8 GiB part (the state
    copied into a conditional's results) that no micro-batch moved."""
    from jaxppo.plan import breakdown as bd
    from jaxppo.plan.costs import per_device_bytes

    transformers.LlamaConfig(vocab_size=32768, hidden_size=512, intermediate_size=1024, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             eos_token_id=2, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    target = resolve_target(name)
    plans = {mini: plan_run(_config(batch_size=16, mini_batch_size=mini, query_length=128, response_length=128),
                            _inputs(str(tmp_path)), target, programs=("update",)) for mini in (4, 16)}
    temporaries = {mini: plan.programs[0].memory.temporaries for mini, plan in plans.items()}
    assert temporaries[16] > 2 * temporaries[4], temporaries
    at_zero = temporaries[4] - 4 * (temporaries[16] - temporaries[4]) / 12
    shapes = abstract_run(plans[4].config, _inputs(str(tmp_path)), target_devices(target))
    gradients = per_device_bytes(shapes.run.train.trained_params())
    layer = 2 * (4 * 512 * 512 + 3 * 512 * 1024)  # one layer's matrices in bf16, gathered whole (an upper bound)
    assert at_zero <= gradients + 2 * layer, (at_zero, gradients, temporaries)
    for plan in plans.values():
        b = plan.programs[0].breakdown
        assert b is not None and b.part(bd.STATE_COPIES) == 0, b.text()
    # What grows with the rows is what the breakdown calls activations and logits.
    grows = lambda mini: sum(plans[mini].programs[0].breakdown.part(p) for p in (bd.ACTIVATIONS, bd.LOGITS))  # noqa: E731
    assert grows(16) - grows(4) > 0.5 * (temporaries[16] - temporaries[4]), (grows(4), grows(16), temporaries)


@pytest.mark.parametrize("name", TARGETS)
def test_a_mixtures_decode_step_runs_every_expert_in_one_product_per_projection(tmp_path, name, monkeypatch):
    """The decode step of a Qwen3-MoE layout (64 experts, 8 a token; 16 rows decode) as the
    target's compiler builds it: with few tokens a layer multiplies them with every expert
    at once (`moe.every_expert`), so the step has no loop over blocks of rows (whose trips,
    up to E a projection, the compiler cannot count) and fewer kernels than the grouped
    products' step even when each of that loop's bodies is counted once. (On a TPU the
    grouped products are `ragged_dot`s, without a loop: there the step is a little shorter, 196 -> 164.)"""
    from jaxppo.models import moe
    from jaxppo.plan.costs import decode_step

    transformers.Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
                                max_position_embeddings=256, eos_token_id=2,
                                architectures=["Qwen3MoeForCausalLM"]).save_pretrained(tmp_path)
    target = resolve_target(name)
    steps = {}
    for dense_tokens in (0, moe.DENSE_TOKENS):
        monkeypatch.setattr(moe, "DENSE_TOKENS", dense_tokens)
        jax.clear_caches()  # the path is chosen when the program is traced
        shapes = abstract_run(_config(), _inputs(str(tmp_path)), target_devices(target)[:1])
        hlo = lower_programs(shapes, ("generate",))["generate"].compile().as_text()
        steps[dense_tokens] = decode_step(hlo, steps=_config().sampling.response_length)
    jax.clear_caches()
    # The products run on the experts' kernels as stored: no transposed copy of a layer's
    # (E, D, I) or (E, I, D) kernels (as "nd,edf->enf", XLA:GPU made one at every step).
    assert not re.search(r"= bf16\[64,(256,128|128,256)\]\{[0-9,]*\} transpose\(", hlo)
    grouped, dense = steps[0], steps[moe.DENSE_TOKENS]
    assert dense.unknown_trip_loops == 0, dense
    if target.platform == "tpu":  # there the grouped products are one ragged_dot each
        assert dense.kernels < grouped.kernels, (grouped, dense)
    else:  # measured on the H200: at least 225 (6 loops, each body counted once) -> 70
        assert grouped.unknown_trip_loops >= 3 * LAYERS and dense.kernels < grouped.kernels / 2, (grouped, dense)


@pytest.mark.skipif(not all(HAVE.values()) and not os.environ.get("JAXPPO_REQUIRE_PLAN"),
                    reason="the GPU and TPU compilers are not installed (pip install 'jaxppo[plan-gpu,plan-tpu]')")
def test_the_command_plans_both_targets_and_refuses_a_mesh_the_topology_does_not_divide(config_dir, capsys):
    args = ["--model", config_dir, "--prompts", "unused.jsonl", "--batch-size", "16", "--mini-batch-size", "8",
            "--query-length", "16", "--response-length", "16", "--lora-rank", "4", "--dtype", "bfloat16"]
    assert cli_main(["plan", "--target", "h200", "--target", "v5e-4", *args]) == 0
    out = capsys.readouterr().out
    assert out.count("\nfits\n") == 2 and "kernels per decode step" in out and "LoRA rank 4" in out
    with pytest.raises(SystemExit, match="mesh axes .* do not divide the 8 devices"):
        cli_main(["plan", "--target", "h200x8", "--mesh-tensor", "3", *args])
