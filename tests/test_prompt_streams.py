"""Prompts that stream (`jaxppo.rollout.streams.PromptStream`), mixtures with weights
(`jaxppo.rollout.mix_prompts`) and over-long prompts filtered out (`overlong_prompts="filter"`).

The references are plain: the prompts a run must see are computed here by walking the
source in a Python loop (with the tokenizer's own lengths for the filter), and a resumed
run is compared with the uninterrupted one."""

import itertools
import json

import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.rollout.prompts import PromptEncoder, load_prompts
from jaxppo.rollout.streams import PromptStream, read_prompt_records
from trainer_setup import small_trainer

# 40 records, every fifth far over the tests' query length of 32 tokens (ByT5: a token a byte).
RECORDS = [{"prompt": (f"p{i} " + "long " * 10) if i % 5 == 3 else f"p{i} say", "answer": i} for i in range(40)]


def _fits(text: str) -> bool:
    return len(demo.demo_tokenizer()(text)["input_ids"]) <= 32


KEPT = [r for r in RECORDS if _fits(r["prompt"])]  # the plain reference of what the filter keeps


class Seen:
    """A reward function that records the prompts and answers of each call (one per iteration)."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, answer):
        self.calls.append(list(zip(prompts, answer)))
        return demo.lowercase_reward(prompts, completions)


def _run(path, source, iterations, reward=None, **settings):
    reward = reward or Seen()
    trainer = small_trainer(path, iterations=iterations, prompts=source, reward_fns=reward,
                            overlong_prompts="filter", **settings)
    return trainer.train(), reward, trainer


def test_a_stream_is_read_in_order_filtered_walked_again_and_resumed_exactly(tmp_path, capsys):
    """A function returning an iterator is read in its order, over-long prompts left out
    (and counted), and read again from its start when it ends; a one-shot generator that ends
    stops the run with a checkpoint, and the same run resumed with the stream continues where
    it stopped: its third iteration equal to the uninterrupted run's."""
    whole, seen, _ = _run(tmp_path / "whole", lambda: iter(RECORDS), 3)
    stream = list(itertools.islice(itertools.cycle(KEPT), 48))  # 32 kept per pass, then the second pass
    expected = [[(r["prompt"], r["answer"]) for r in stream[16 * i:16 * (i + 1)]] for i in range(3)]
    assert seen.calls == expected
    assert [h["data/prompts_filtered"] for h in whole] == [4, 8, 12]  # read up to each iteration's last prompt

    first, seen_first, trainer = _run(tmp_path / "cut", iter(RECORDS), 3)  # one pass only: ends in iteration 2
    assert len(first) == 2 and trainer.iteration == 2 and seen_first.calls == expected[:2]
    assert "stopped after 2 iterations (of 3): the prompt stream (a one-shot iterator) ended" in capsys.readouterr().out
    resumed, seen_resumed, _ = _run(tmp_path / "cut", lambda: iter(RECORDS), 3)
    assert seen_resumed.calls == expected[2:]
    timing = {k for k in whole[-1] if k.startswith("time/") or k == "eps"}
    assert {k: v for k, v in resumed[-1].items() if k not in timing} == {
        k: v for k, v in whole[-1].items() if k not in timing}
    other = small_trainer(tmp_path / "cut", iterations=4, prompts=lambda: iter(RECORDS[1:]), reward_fns=Seen(),
                          overlong_prompts="filter")
    with pytest.raises(jaxppo.RunError, match=r"(?s)other settings.*prompts.first_sha256"):  # another stream is refused
        other.directory.open(other.run, other.settings())


def test_a_pipelined_run_reads_the_stream_in_order(tmp_path):
    """Sampling one iteration ahead (another thread reading the stream) sees the same order."""
    _, seen, _ = _run(tmp_path, lambda: iter(RECORDS), 3, max_staleness=1)
    stream = list(itertools.islice(itertools.cycle(KEPT), 48))
    assert seen.calls == [[(r["prompt"], r["answer"]) for r in stream[16 * i:16 * (i + 1)]] for i in range(3)]


def _encoder(overlong="error"):
    return PromptEncoder(demo.demo_tokenizer(), 32, overlong)


def test_the_filter_on_a_table_keeps_what_fits():
    prompts = [r["prompt"] for r in RECORDS]
    table = _encoder("filter").table(prompts, {"answer": [r["answer"] for r in RECORDS]}, [str(i) for i in range(40)])
    assert table.prompts == [r["prompt"] for r in KEPT] and table.columns["answer"] == [r["answer"] for r in KEPT]
    assert table.filtered == len(RECORDS) - len(KEPT) == 8
    truncated = _encoder("truncate").table(prompts, {}, [str(i) for i in range(40)])
    assert truncated.filtered == 0 and truncated.mask.sum(1).max() == 32
    with pytest.raises(ValueError, match=r"^3 has 5\d tokens, longer than DataConfig.query_length=32"):
        _encoder("error").table(prompts, {}, [str(i) for i in range(40)])


class Epochs:
    """A re-iterable source that records the passes `set_epoch` announces (as a
    `datasets.IterableDataset` is told)."""

    def __init__(self, items):
        self.items, self.epochs = items, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(self.items)


def test_a_stream_holds_only_what_is_near_its_front_and_says_so():
    source = Epochs([f"q{i}" for i in range(10)])
    stream = PromptStream(source, _encoder(), keep_behind=4)
    assert list(stream.rows_at(None, 0, 3)) == [0, 1, 2] and stream.prompts[2] == "q2"
    assert list(stream.rows_at(None, 12, 4)) == [12, 13, 14, 15]  # passes over 3..11 unrendered
    assert [stream.texts[r] for r in range(12, 16)] == ["q2", "q3", "q4", "q5"] and source.epochs == [0, 1]
    ids = stream.ids[np.asarray([12, 13])]
    assert ids.shape == (2, 32) and stream.mask[np.asarray([12])].sum() == len(demo.demo_tokenizer()("q2")["input_ids"])
    stream.rows_at(None, 40, 1)
    with pytest.raises(KeyError, match="position 13 is no longer held"):
        stream.prompts[13]


def test_a_datasets_iterable_dataset_streams_with_its_columns():
    datasets = pytest.importorskip("datasets")
    source = datasets.IterableDataset.from_generator(lambda: iter(RECORDS[:6]))
    stream = PromptStream(source, _encoder("filter"))
    rows = stream.rows_at(None, 0, 7)  # the fifth record is over-long: the seventh position is pass 2's first
    assert [stream.prompts[r] for r in rows] == [RECORDS[i]["prompt"] for i in (0, 1, 2, 4, 5, 0, 1)]
    assert [stream.columns["answer"][r] for r in rows] == [0, 1, 2, 4, 5, 0, 1] and stream.filtered == 1


def test_a_streamed_file_is_read_only_as_far_as_the_run_reaches(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:20]) + '{"prompt": broken\n')
    stream = PromptStream(read_prompt_records(str(path)), _encoder("filter"))
    rows = stream.rows_at(None, 0, 16)
    assert [stream.prompts[r] for r in rows] == [r["prompt"] for r in KEPT[:16]]
    with pytest.raises(ValueError, match=r"p.jsonl line 21 is not valid JSON"):
        stream.rows_at(None, 16, 1)


def test_a_mixture_draws_by_weight_reproducibly_and_walks_each_source_whole(tmp_path):
    a = [f"a{i}" for i in range(7)]
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"b{i}", "answer": i}) + "\n" for i in range(5)))
    mix = jaxppo.rollout.mix_prompts([a, str(path)], [3, 1], seed=4, source_column="source")
    draws = [record for record, _ in itertools.islice(iter(mix), 4000)]
    again = [record for record, _ in itertools.islice(iter(mix), 4000)]
    assert draws == again
    from_a = [d for d in draws if d["source"] == "source 0"]
    # Binomial(4000, 3/4): mean 3000, standard deviation 27.4; five of them either side.
    assert abs(len(from_a) - 3000) < 137
    # each pass over a source read whole holds every record once
    firsts = [d["prompt"] for d in from_a[:21]]
    assert all(sorted(firsts[k:k + 7]) == sorted(a) for k in (0, 7, 14)) and firsts[:7] != firsts[7:14]
    from_b = [d for d in draws if d["source"] == str(path)]
    assert sorted((d["prompt"], d["answer"]) for d in from_b[:5]) == [(f"b{i}", i) for i in range(5)]
    other_seed = [record for record, _ in itertools.islice(iter(jaxppo.rollout.mix_prompts([a, str(path)], [3, 1], seed=5)),
                                                            50)]
    assert [r["prompt"] for r in other_seed] != [d["prompt"] for d in draws[:50]]


def test_a_mixture_with_a_one_shot_source_ends_with_it_and_bad_weights_are_refused():
    mix = jaxppo.rollout.mix_prompts([iter(["x", "y"]), ["z"]], [1, 0])
    assert [record for record, _ in iter(mix)] == ["x", "y"]
    for weights, message in (([1], "2 sources but 1 weights"), ([1, -1], "weights=\\[1, -1\\] are invalid"),
                             ([0, 0], "their sum > 0")):
        with pytest.raises(ValueError, match=message):
            jaxppo.rollout.mix_prompts([["a"], ["b"]], weights)


def test_stream_prompts_streams_a_list_in_its_order_and_load_prompts_is_unchanged(tmp_path):
    """`stream_prompts=True` walks a list in its own order (no reshuffle); a table of the same
    prompts is the reshuffled walk as before."""
    prompts = [f"p{i}" for i in range(20)]
    trainer = small_trainer(tmp_path, prompts=prompts, stream_prompts=True)
    assert [trainer.parts.table.texts[r] for r in trainer.prompt_indices(1)] == prompts[16:] + prompts[:12]
    table = small_trainer(tmp_path / "t", prompts=prompts)
    assert sorted(table.prompt_indices(0)) != list(range(16))  # a table's walk is reshuffled
    assert load_prompts(prompts) == prompts
