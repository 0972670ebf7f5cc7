"""`jaxppo.plan` on this machine's CPU devices (no extra needed): the programs it builds are
the run's, its work counts agree with XLA's own count on a program without loops, its
kernel count reads HLO as written, and bad input is refused naming the fix. The GPU and TPU
targets themselves: tests/test_plan_targets.py (CI's plan stage installs their compilers)."""

import importlib.metadata
import json

import jax
import pytest
import transformers

import jaxppo
from jaxppo.cli import main as cli_main
from jaxppo.plan import MissingExtra, Target, plan_run, resolve_target, target_devices
from jaxppo.plan.costs import DecodeStep, count_kernels, decode_kernels, decode_step, per_device_bytes
from jaxppo.plan.programs import abstract_run, lower_programs
from jaxppo.plan.report import run_work
from jaxppo.run.parts import Inputs


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A Llama-layout checkpoint directory holding config.json alone (no weights)."""
    d = tmp_path_factory.mktemp("config_only")
    transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             eos_token_id=2, architectures=["LlamaForCausalLM"]).save_pretrained(d)
    return str(d)


def _inputs(path, **kw):
    return Inputs(policy=path, tokenizer=None, prompts=None, **kw)


def _cpu_target(chips=1):
    return Target(f"cpu{chips}", "cpu", chips, "", 4 * 2 ** 30, 1e12, 1e11)


def _config(algorithm="ppo", **kw):
    settings = dict(batch_size=8, mini_batch_size=8, ppo_epochs=1, response_length=16, query_length=16)
    return jaxppo.Config.for_algorithm(algorithm, **{**settings, **kw})


def test_the_work_counted_from_shapes_matches_xlas_count_on_a_program_without_loops(config_dir):
    """Unrolled layers, one mini-batch, one epoch, the whole LM head: XLA's cost analysis
    counts every operation once, which is then exact; the plan's model FLOPs (matrix
    products, attention as computed) are those less the elementwise work, a few percent."""
    for algorithm, kw in (("ppo", {}), ("grpo", {"num_generations": 2})):
        shapes = abstract_run(_config(algorithm, scan_layers=False, **kw), _inputs(config_dir), jax.devices()[:1])
        work = run_work(shapes)
        for name, lowered in lower_programs(shapes, ("update", "score")).items():
            xla = lowered.compile().cost_analysis()["flops"]
            assert 1.0 <= xla / work[name].flops <= 1.2, (algorithm, name, xla, work[name].flops)


def test_the_planned_update_holds_the_run_state_and_follows_the_mini_batch(config_dir):
    """The update's arguments are the train state and the rollout, byte for byte as their
    shapes say; its temporaries grow with mini_batch_size (what peak memory follows)."""
    temps = {}
    for mini in (2, 8):
        shapes = abstract_run(_config(mini_batch_size=mini), _inputs(config_dir), jax.devices()[:1])
        compiled = lower_programs(shapes, ("update",))["update"].compile()
        stats = compiled.memory_analysis()
        state = per_device_bytes(shapes.run.train)
        args = stats.argument_size_in_bytes
        assert state < args < state + 64 * 1024, (state, args)  # + the rollout (8 rows of 32 tokens) and the key
        temps[mini] = stats.temp_size_in_bytes
    assert temps[8] > 1.5 * temps[2], temps


def test_a_plan_on_eight_devices_shards_the_state_and_reports_each_program(config_dir):
    plan = plan_run(_config(batch_size=16, mini_batch_size=8), _inputs(config_dir), _cpu_target(8),
                    devices=jax.devices()[:8])
    assert plan.mesh_axes == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    one = plan_run(_config(batch_size=16, mini_batch_size=8), _inputs(config_dir), _cpu_target(1),
                   devices=jax.devices()[:1])
    by_name = {p.name: p for p in plan.programs}
    single = {p.name: p for p in one.programs}
    assert set(by_name) == {"update", "score", "generate"}
    # The parameters and optimizer states split over 8 devices: the update's arguments shrink.
    assert by_name["update"].memory.arguments < single["update"].memory.arguments / 3
    assert by_name["generate"].decode_kernels > 0 and single["generate"].decode_kernels > 0
    assert plan.fits and "fits" in plan.text()
    # Work is the same in all; the floor per chip is lower on eight.
    assert by_name["update"].work.flops == single["update"].work.flops
    assert plan.lower_bound_s < one.lower_bound_s


def test_a_run_that_does_not_fit_is_told_what_to_change(config_dir):
    tiny = Target("small", "cpu", 1, "", 2 ** 20, 1e12, 1e11)  # 1 MiB per device
    plan = plan_run(_config(dtype="float32"), _inputs(config_dir), tiny, devices=jax.devices()[:1])
    assert not plan.fits
    advice = " ".join(plan.advice())
    assert "--remat full" in advice and "--lora-rank" in advice and "--dtype bfloat16" in advice
    assert "DOES NOT FIT" in plan.text()


def test_lora_plans_the_adapters_alone_as_trained(config_dir):
    from jaxppo.models.lora import LoraConfig

    lora = LoraConfig(rank=4, alpha=8.0, targets=("all-linear",))
    full = abstract_run(_config("grpo", num_generations=2), _inputs(config_dir), jax.devices()[:1])
    with_lora = _config("grpo", num_generations=2).replace(**jaxppo.AdapterConfig.of(lora))
    adapters = abstract_run(with_lora, _inputs(config_dir), jax.devices()[:1])
    assert per_device_bytes(adapters.run.train.opt_state) < per_device_bytes(full.run.train.opt_state) / 5
    assert run_work(adapters)["update"].flops < run_work(full)["update"].flops


def test_kernels_are_counted_per_loop_trip_and_the_decode_loop_is_found():
    hlo = """HloModule m

%inner_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %g = f32[4] get-tuple-element(%p), index=1
  %f = f32[4] fusion(%g), kind=kLoop, calls=%fused
  ROOT %t = (s32[], f32[4]) tuple(%i, %f)
}

%inner_cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  ROOT %c = pred[] compare(%a, %b), direction=LT
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %a = f32[4] fusion(%p), kind=kLoop, calls=%fused.1
  %b = f32[4] custom-call(%a), custom_call_target="__cublas$gemm"
  %w = (s32[], f32[4]) while(%x), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[], f32[4]) tuple(%i, %b)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  ROOT %c = pred[] compare(%a, %b), direction=LT
}

%small_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = f32[4] fusion(%p), kind=kLoop, calls=%fused.2
  ROOT %t = (s32[], f32[4]) tuple(%i, %a)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4] parameter(0)
  %pre = (s32[], f32[4]) while(%x), condition=%cond, body=%small_body, metadata={op_name="prefill"}
  %decode = (s32[], f32[4]) while(%pre), condition=%cond, body=%body, metadata={op_name="decode"}
  ROOT %r = f32[4] get-tuple-element(%decode), index=1
}
"""
    # One decode step: 2 (fusion, library call) + 3 x (1 fusion + 1 compare) + 1 compare.
    assert decode_kernels(hlo) == 2 + 3 * 2 + 1
    assert decode_step(hlo).unknown_trip_loops == 0
    # The inner loop without its known trip count (a loop over a traced count, as a
    # mixture's blocked products run): counted once, and said to be.
    unknown = hlo.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    assert decode_step(unknown) == DecodeStep(kernels=2 + 2 + 1, gathered_bytes=0, unknown_trip_loops=1)
    assert count_kernels({"c": ["  %a = f32[] fusion(%x), calls=%f", "  %b = f32[] bitcast(%a)"]}, "c") == 1


def test_the_decode_loop_is_the_top_loop_that_runs_the_most_kernels_in_all():
    """Of the loops at the top of a sampler: a prefill's layer loop (2 trips of 4 kernels),
    a prefill's loop of unknown trips (1 kernel), and the decode loop (31 trips of 2): the
    decode loop, though a trip of the layer loop launches more."""
    hlo = """HloModule m

%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%layer (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = f32[4] fusion(%p), kind=kLoop, calls=%f1
  %b = f32[4] fusion(%a), kind=kLoop, calls=%f2
  %c = f32[4] fusion(%b), kind=kLoop, calls=%f3
  ROOT %d = f32[4] fusion(%c), kind=kLoop, calls=%f4
}

%blocks (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  ROOT %a = f32[4] fusion(%p), kind=kLoop, calls=%f5
}

%step (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = f32[4] fusion(%p), kind=kLoop, calls=%f6
  ROOT %b = f32[4] fusion(%a), kind=kLoop, calls=%f7
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4] parameter(0)
  %pre = (s32[], f32[4]) while(%x), condition=%cond, body=%layer, backend_config={"known_trip_count":{"n":"2"}}
  %blk = (s32[], f32[4]) while(%pre), condition=%cond, body=%blocks
  %dec = (s32[], f32[4]) while(%blk), condition=%cond, body=%step, backend_config={"known_trip_count":{"n":"31"}}
  ROOT %r = f32[4] get-tuple-element(%dec), index=1
}
"""
    assert decode_step(hlo) == DecodeStep(kernels=2, gathered_bytes=0, unknown_trip_loops=0)
    # Decoding with an early stop: its loop's trips unknown, taken as the tokens decoded.
    early = hlo.replace(', body=%step, backend_config={"known_trip_count":{"n":"31"}}', ", body=%step")
    assert decode_step(early, steps=31).kernels == 2


def test_decode_kernels_of_a_real_sampler_grow_with_its_layers(tmp_path):
    counts = {}
    for layers in (2, 4):
        d = tmp_path / f"l{layers}"
        transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                 architectures=["LlamaForCausalLM"]).save_pretrained(d)
        shapes = abstract_run(_config(scan_layers=False), _inputs(str(d)), jax.devices()[:1])
        counts[layers] = decode_kernels(lower_programs(shapes, ("generate",))["generate"].compile().as_text())
    assert counts[4] > counts[2] > 0, counts


def test_targets_known_and_from_a_file(tmp_path):
    assert resolve_target("H200x1") is resolve_target("h200")
    assert resolve_target("v5p-8").chips == 4 and resolve_target("v5e-16").topology == "v5e:4x4"
    with pytest.raises(ValueError, match="not a known target.*h200x8"):
        resolve_target("h300")
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"platform": "tpu", "chips": 4, "topology": "v5e:2x2", "memory_gib": 16,
                             "peak_tflops": 197, "bandwidth_gbs": 819}))
    mine = resolve_target(str(f))
    assert (mine.platform, mine.chips, mine.usable_bytes) == ("tpu", 4, 16 * 2 ** 30)
    f.write_text(json.dumps({"platform": "gpu", "chips": 1, "memory_gib": 1, "peak_tflops": 1, "bandwidth_gbs": 1}))
    with pytest.raises(ValueError, match="platform='gpu' is invalid: 'cuda'"):
        resolve_target(str(f))
    f.write_text(json.dumps({"platform": "cuda", "chips": 1, "memory": 80}))
    with pytest.raises(ValueError, match=r"unknown keys \['memory'\].*missing keys"):
        resolve_target(str(f))


def test_a_missing_compiler_names_the_extra(monkeypatch):
    real = importlib.metadata.version

    def version(name):
        if name in ("libtpu", "jax-cuda12-plugin"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(MissingExtra, match=r"pip install 'jaxppo\[plan-tpu\]'"):
        target_devices(resolve_target("v5e-8"))
    with pytest.raises(MissingExtra, match=r"pip install 'jaxppo\[plan-gpu\]'"):
        target_devices(resolve_target("h200"))


def test_the_command_refuses_bad_input_in_one_line(config_dir, capsys):
    with pytest.raises(SystemExit, match="give --target NAME"):
        cli_main(["plan", "--model", config_dir])
    with pytest.raises(SystemExit, match="'h300' is not a known target"):
        cli_main(["plan", "--target", "h300", "--model", config_dir])
    with pytest.raises(SystemExit, match="give --model DIR"):
        cli_main(["plan", "--target", "h200"])
    with pytest.raises(SystemExit, match=r"--images '2x448' is invalid: give COUNTxHEIGHTxWIDTH"):
        cli_main(["plan", "--target", "h200", "--images", "2x448", "--model", config_dir])
    with pytest.raises(SystemExit, match=r"--images: the policy \(llama\) reads text only; plan it without"):
        cli_main(["plan", "--target=h200", "--images=1x448x448", "--model", config_dir])
    assert cli_main(["plan", "--help"]) == 0
    assert "h200x8" in capsys.readouterr().out


def test_a_config_only_checkpoint_has_the_shapes_of_the_real_one(tmp_path):
    """`ConfigOnly` reads config.json alone; its parameters have exactly the shapes and dtypes
    that loading the checkpoint's weights gives (transformers wrote them)."""
    import torch

    from jaxppo.models.hf import ConfigOnly, from_pretrained

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    for scan in (False, True):
        real_model, real = from_pretrained(str(tmp_path), "bfloat16", param_dtype="float32", scan_layers=scan)
        built = {}

        def load(scan=scan):
            built["model"], params = from_pretrained(ConfigOnly(str(tmp_path)), "bfloat16", param_dtype="float32",
                                                     scan_layers=scan)
            return params

        shapes = jax.eval_shape(load)
        assert built["model"] == real_model
        assert jax.tree.structure(shapes) == jax.tree.structure(real)
        assert jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), shapes, real) == \
            jax.tree.map(lambda _: True, real)


def test_a_program_the_targets_compiler_refuses_does_not_fit_and_says_why():
    """The TPU compiler refuses a program over the HBM (RESOURCE_EXHAUSTED): the plan keeps
    its words and counts the run as not fitting."""
    from jaxppo.plan import Plan, ProgramPlan
    from jaxppo.plan.costs import MemoryFigures, ProgramWork

    target = resolve_target("v5e-16")
    work = ProgramWork(1e15, 1e9)
    words = "Ran out of memory on HBM, the total memory required for HLO temporaries (15.77G) exceeds available HBM"
    refused = ProgramPlan("update", 1.0, None, 0, work, 0.5, refused=words)
    fine = ProgramPlan("score", 1.0, MemoryFigures(2 ** 30, 0, 0, 2 ** 30), 2 ** 30, work, 0.5)
    plan = Plan(target, (refused, fine), {"data": 1, "fsdp": 16, "tensor": 1}, "a run", _config(dtype="bfloat16"))
    assert not plan.fits and plan.lower_bound_s == 1.0
    text = plan.text()
    assert f"DOES NOT FIT: the compiler: {words}" in text and "does not fit: a smaller micro-batch" in text
    assert "--mesh-fsdp" not in text  # every chip is on fsdp already


def test_the_peak_is_broken_down_by_what_it_holds_and_the_advice_follows_the_largest_part(tmp_path):
    """The update's arguments are named byte for byte (parameters, optimizer state, the
    rollout); its temporaries at the arena's peak add up to at most the arena, and the part
    that grows with the micro-batch is the activations (with the logits). Advice follows
    the largest parts: a run whose update is activations gets "a smaller micro-batch"
    first, and following it lowers the peak; a run whose update is its state gets no
    micro-batch advice (a smaller micro-batch would not help it)."""
    from jaxppo.plan import breakdown as bd

    wide = tmp_path / "wide"  # activations dominate: a small model over long rows
    transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             eos_token_id=2, architectures=["LlamaForCausalLM"]).save_pretrained(wide)
    heavy = tmp_path / "heavy"  # the state dominates: a wide model over a few short rows
    transformers.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             eos_token_id=2, architectures=["LlamaForCausalLM"]).save_pretrained(heavy)
    tiny = Target("small", "cpu", 1, "", 2 ** 20, 1e12, 1e11)  # 1 MiB: nothing fits
    plans = {}
    for name, path, mini, length in (("wide8", wide, 8, 512), ("wide4", wide, 4, 512), ("heavy", heavy, 2, 8)):
        config = _config(batch_size=8, mini_batch_size=mini, query_length=length, response_length=length,
                         dtype="bfloat16", logits_chunk_size=64)
        plans[name] = plan_run(config, _inputs(str(path)), tiny, devices=jax.devices()[:1], programs=("update",))
    for name, plan in plans.items():
        (update,) = plan.programs
        b = update.breakdown
        assert b is not None, name
        shapes = abstract_run(plan.config, _inputs(str(wide if name != "heavy" else heavy)), jax.devices()[:1])
        assert b.part("parameters") == per_device_bytes(shapes.run.train.params)
        assert b.part("optimizer state") == per_device_bytes(shapes.run.train.opt_state)
        assert sum(v for _, v in b.arguments) == update.memory.arguments
        assert 0 < sum(v for _, v in b.temporaries) <= b.arena == update.memory.temporaries
        assert b.part(bd.STATE_COPIES) <= b.part("parameters")  # never more than the state itself
    grown = lambda part: plans["wide8"].programs[0].breakdown.part(part) - plans["wide4"].programs[0].breakdown.part(part)
    assert grown(bd.ACTIVATIONS) > 0.5 * (plans["wide8"].programs[0].memory.temporaries
                                          - plans["wide4"].programs[0].memory.temporaries)
    assert plans["wide8"].programs[0].breakdown.largest() == bd.ACTIVATIONS
    assert plans["wide8"].advice()[0].startswith("a smaller micro-batch")
    assert plans["wide4"].programs[0].memory.peak < plans["wide8"].programs[0].memory.peak
    heavy_update = plans["heavy"].programs[0].breakdown
    assert heavy_update.largest() in ("optimizer state", "parameters"), heavy_update.text()
    advice = " ".join(plans["heavy"].advice())
    assert "micro-batch" not in advice and "--lora-rank" in advice, advice
    assert "optimizer state" in plans["heavy"].text() and "temporaries at their peak" in plans["heavy"].text()


def test_values_are_sorted_by_shape_dtype_and_opcode():
    from jaxppo.plan import breakdown as bd

    shapes = bd.ValueShapes(trained=frozenset({(64, 32)}), state=frozenset({(64, 32), (32,)}),
                            weights_local=frozenset({(64, 32)}), weights_full=frozenset({(512, 32), (64, 32)}),
                            vocab=frozenset({1000}), kv_tails=frozenset({tuple(sorted((96, 2, 16)))}))
    assert bd.classify("bf16[512,32]{1,0}", "all-gather", shapes) == bd.GATHERED
    assert bd.classify("f32[64,32]{1,0}", "copy", shapes) == bd.STATE_COPIES
    assert bd.classify("f32[64,32]{1,0}", "fusion", shapes) == bd.GRADIENTS
    assert bd.classify("bf16[64,32]{1,0}", "fusion", shapes) == bd.WEIGHT_COPIES
    assert bd.classify("bf16[8,2,96,16]{3,2,1,0}", "fusion", shapes) == bd.KV_CACHE
    assert bd.classify("f32[8,7,1000]{2,1,0}", "fusion", shapes) == bd.LOGITS
    assert bd.classify("f32[8,7,64]{2,1,0}", "fusion", shapes) == bd.ACTIVATIONS
    assert bd.classify("(f32[8], s32[])", "tuple", shapes) == bd.ACTIVATIONS


def test_the_bytes_a_decode_step_gathers_are_counted_per_trip():
    """All-gathers in the decode loop (and in a layer loop inside it, per trip) add up
    their results' bytes; an asynchronous start counts its gathered arrays, not its
    operands, also where the compiler combined several gathers into one start; a gather
    outside the decode loop does not count."""
    from jaxppo.plan.costs import decode_gathered_bytes

    hlo = """HloModule m

%layer (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p = (s32[], bf16[4,8]) parameter(0)
  %w = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %ag = (bf16[2,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%w), dimensions={0}
  %agd = bf16[16,8]{1,0} all-gather-done(%ag)
  %v = f32[1,8]{1,0} get-tuple-element(%p), index=2
  %ag2 = ((bf16[2,8]{1,0}, f32[1,8]{1,0}), (bf16[16,8]{1,0}, f32[8,8]{1,0})) all-gather-start(%w, %v), dimensions={0}
  %agd2 = (bf16[16,8]{1,0}, f32[8,8]{1,0}) all-gather-done(%ag2)
  ROOT %t = (s32[], bf16[4,8]) tuple(%p)
}

%cond (p: (s32[], bf16[4,8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%step (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p = (s32[], bf16[4,8]) parameter(0)
  %l = (s32[], bf16[4,8]) while(%p), condition=%cond, body=%layer, backend_config={"known_trip_count":{"n":"3"}}
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %g = f32[32,8]{1,0} all-gather(%x), dimensions={0}
  ROOT %t = (s32[], bf16[4,8]) tuple(%l)
}

ENTRY %main (a: bf16[4,8]) -> (s32[], bf16[4,8]) {
  %a = bf16[4,8]{1,0} parameter(0)
  %pre = bf16[64,8]{1,0} all-gather(%a), dimensions={0}
  %i = (s32[], bf16[4,8]) tuple(%a)
  ROOT %w = (s32[], bf16[4,8]) while(%i), condition=%cond, body=%step, backend_config={"known_trip_count":{"n":"10"}}
}
"""
    # per decode step: 3 layer trips x (16*8 bf16 + a combined start of 16*8 bf16 and 8*8
    # f32: each of its results) + 32*8 f32
    assert decode_gathered_bytes(hlo) == 3 * (16 * 8 * 2 + 16 * 8 * 2 + 8 * 8 * 4) + 32 * 8 * 4


def test_a_copy_of_zeros_is_a_gradient_accumulator_not_a_state_copy(tmp_path):
    """XLA starts a loop's gradient accumulator by copying a broadcast of zeros; that copy
    is a gradient, a copy of anything else of the state's shape a state-sized copy."""
    from jaxppo.plan import breakdown as bd

    hlo = tmp_path / "m.txt"
    hlo.write_text("  %loop_broadcast_fusion.12 = f32[4,8]{1,0} fusion(%c), kind=kLoop\n"
                   "  %copy.1 = f32[4,8]{1,0} copy(%loop_broadcast_fusion.12), metadata={}\n"
                   "  %copy.2 = f32[4,8]{1,0} copy(%param.3), metadata={}\n")
    opcodes = bd._opcodes(str(hlo))
    assert opcodes == {"loop_broadcast_fusion.12": "fusion", "copy.1": "copy-of-broadcast", "copy.2": "copy"}
    shapes = bd.ValueShapes(trained=frozenset({(4, 8)}), state=frozenset({(4, 8)}))
    assert bd.classify("f32[4,8]{1,0}", opcodes["copy.1"], shapes) == bd.GRADIENTS
    assert bd.classify("f32[4,8]{1,0}", opcodes["copy.2"], shapes) == bd.STATE_COPIES


def test_a_vision_language_policys_images_are_planned_where_given(tmp_path):
    """A Qwen2.5-VL checkpoint (config.json only): planned on text prompts its summary says
    the images are not in the figures; with two 32 x 48 images per prompt, every program is
    compiled with the batch's images (the update's arguments grow by the pixel values, the
    scoring pass's temporaries by the encoder's work), and sizes the encoder cannot take or
    image tokens that fill the prompt are refused naming the fix."""
    from vision_models import IMAGE, VISION

    text = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000.0})
    transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=64),
                                  image_token_id=IMAGE,
                                  architectures=["Qwen2_5_VLForConditionalGeneration"]).save_pretrained(tmp_path)
    config = _config("grpo", num_generations=2, query_length=64)
    one = jax.devices()[:1]
    plain = plan_run(config, _inputs(str(tmp_path)), _cpu_target(), devices=one)
    assert "a vision-language policy planned on text prompts: its images and the vision encoder's work are not" \
        in plain.summary
    planned = plan_run(config, _inputs(str(tmp_path)), _cpu_target(), devices=one, images=(2, 32, 48))
    assert "2 image(s) of 32 x 48 pixels per prompt (48 of its 64 tokens" in planned.summary
    with_images, without = ({p.name: p for p in plan.programs} for plan in (planned, plain))
    pixels = 8 * 2 * (32 // 4) * (48 // 4) * VISION["patch_size"] ** 2 * 3 * 2 * 4  # rows x patches x values, f32
    assert with_images["update"].memory.arguments >= without["update"].memory.arguments + pixels
    assert with_images["score"].memory.temporaries > without["score"].memory.temporaries
    with pytest.raises(ValueError, match="each side must be a positive multiple of 8"):
        plan_run(config, _inputs(str(tmp_path)), _cpu_target(), devices=one, images=(1, 30, 48))
    with pytest.raises(ValueError, match=r"are 96 image tokens, which leave no room in DataConfig.query_length=64"):
        plan_run(config, _inputs(str(tmp_path)), _cpu_target(), devices=one, images=(4, 32, 48))


def test_a_gemma3_policys_images_are_planned_at_its_one_image_size(tmp_path):
    """A Gemma 3 checkpoint with images (config.json only): every image, whatever its size,
    is planned at the encoder's one square size; the update's arguments grow by the pixel
    values of two such images per row."""
    import vision_models as vm

    vm.tiny_gemma3_vl(tmp_path)
    for name in ("model.safetensors",):
        (tmp_path / name).unlink()
    config = _config("grpo", num_generations=2, query_length=64)
    one = jax.devices()[:1]
    plain = plan_run(config, _inputs(str(tmp_path)), _cpu_target(), devices=one)
    planned = plan_run(config, _inputs(str(tmp_path)), _cpu_target(), devices=one, images=(2, 50, 70))
    assert "2 image(s) of 50 x 70 pixels per prompt (8 of its 64 tokens" in planned.summary
    with_images, without = ({p.name: p for p in plan.programs} for plan in (planned, plain))
    pixels = 8 * 2 * 3 * 16 * 16 * 4  # rows x images x channels x 16 x 16, float32
    assert with_images["update"].memory.arguments >= without["update"].memory.arguments + pixels
    # The floor counts the frozen encoder's forward once per prompt (a group of 2 rows shares
    # its prompt) in the update, the scoring pass and the sampler's prefill: 4 prompts x 2 images.
    from jaxppo.models.hf import checkpoint_config

    one = checkpoint_config(str(tmp_path)).vision.flops(32)
    for name in ("update", "score", "generate"):
        assert with_images[name].work.flops - without[name].work.flops == pytest.approx(4 * 2 * one, rel=1e-9)


def test_long_rows_down_to_one_per_device_are_advised_the_context_axis():
    """An update that does not fit with one row per device is told to split the rows'
    positions (the largest power of two dividing the chips and the row length); with
    several rows per device a smaller micro-batch comes first, and a run with the axis on
    is not told again."""
    from jaxppo.plan.report import advice

    target = resolve_target("h200x8")
    axes = {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    one_row = _config(batch_size=8, mini_batch_size=8, query_length=512, response_length=32768, dtype="bfloat16")
    words = advice(one_row, {"update"}, axes, target)
    assert any(w.startswith("--mesh-context 8 (each row's 33280 positions split over 8 chips") for w in words), words
    odd = _config(batch_size=8, mini_batch_size=8, query_length=500, response_length=32766, dtype="bfloat16")
    assert any(w.startswith("--mesh-context 2 ") for w in advice(odd, {"update"}, axes, target))
    two_rows = _config(batch_size=16, mini_batch_size=16, query_length=512, response_length=32768, dtype="bfloat16")
    assert not any("--mesh-context" in w for w in advice(two_rows, {"update"}, axes, target))
    on = _config(batch_size=8, mini_batch_size=8, query_length=512, response_length=32768, dtype="bfloat16",
                 mesh_context=8)
    assert not any("--mesh-context" in w for w in advice(on, {"update"}, {**axes, "fsdp": 1, "context": 8}, target))
