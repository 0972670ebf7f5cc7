"""Prompts given as chat messages, rendered with the tokenizer's chat template (issue 10,
item 3), on a locally built byte tokenizer that has a template."""

import json

import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.rollout.prompts import load_prompt_table, render_prompts

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {w}."}]
         for w in ("yes", "no", "hi", "ok")]


def tokenizer(template=TEMPLATE):
    tok = demo.demo_tokenizer()
    tok.chat_template = template
    return tok


def trainer_for(tmp_path, tok, prompts, **kwargs):
    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, ppo_epochs=1, num_generations=2)
    tc = dict(iterations=1, query_length=48, response_length=4, output_dir=str(tmp_path),
              progress=False, sample_every=0, export_final=False, plot=False, report_to="jsonl")
    return jaxppo.Trainer(ppo.replace(**tc), policy=demo.demo_policy(tok, width=32, layers=1, max_len=52), tokenizer=tok,
                             prompts=prompts, **kwargs)


def test_messages_are_rendered_with_the_template_and_reach_reward_functions(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": m, "answer": m[1]["content"][4:-1]}) for m in CHATS))
    seen = []

    def reward(prompts, completions, answer):
        seen.append((prompts, answer))
        return [0.0] * len(completions)

    tok = tokenizer()
    trainer = trainer_for(tmp_path / "run", tok, str(path), reward_fns=[reward])
    for messages, ids, mask in zip(CHATS, trainer.parts.table.ids, trainer.parts.table.mask):
        text = tok.decode(ids[mask.astype(bool)].tolist())
        assert text == f"<system>Be brief.\n<user>{messages[1]['content']}\n<assistant>"  # no EOS appended
    trainer.step()
    (prompts, answers), = seen
    assert all(isinstance(p, list) and p[1]["content"] == f"Say {a}." for p, a in zip(prompts, answers))


def test_chat_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="has no chat template to render them"):
        render_prompts(demo.demo_tokenizer(), CHATS)
    with pytest.raises(ValueError, match="chat template is turned off"):
        render_prompts(tokenizer(), CHATS, chat_template=False)
    with pytest.raises(ValueError, match="has no chat template"):
        trainer_for(tmp_path, demo.demo_tokenizer(), CHATS, reward_fns=demo.lowercase_reward)
    with pytest.raises(TypeError, match="mix chat messages and other values: prompt 0 .* prompt 1 is a str"):
        load_prompt_table([CHATS[0], "plain"])
    with pytest.raises(ValueError, match="prompt 0 message 1 is .*a chat message is a dict with a string"):
        load_prompt_table([[{"role": "user", "content": "a"}, {"role": "user"}]])
    assert render_prompts(tokenizer(), ["plain text"]) == (["plain text"], False)  # strings stay as they are


def test_dataset_messages_column_and_cli_flag():
    class Table:  # what load_prompt_table reads from a datasets.Dataset
        column_names = ["messages", "id"]

        def __getitem__(self, name):
            return {"messages": CHATS, "id": list(range(len(CHATS)))}[name]

    prompts, columns = load_prompt_table(Table())
    assert prompts == CHATS and columns == {"id": [0, 1, 2, 3]}
    texts, chat = render_prompts(tokenizer(), prompts)
    assert chat and texts[0].endswith("<user>Say yes.\n<assistant>")
    from jaxppo.cli import resolve

    assert resolve(["--no-chat-template"])[0].data.chat_template is False
    assert resolve([])[0].data.chat_template is None
    np.testing.assert_equal(resolve(["--chat-template"])[0].data.chat_template, True)


def test_prompt_files_are_known_by_their_extension_in_any_case(tmp_path):
    """.JSONL, .Json, .TXT read as their lower-case names are; every role chat templates
    render is accepted."""
    messages = [{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant", "tool", "ipython")]
    (tmp_path / "a.JSONL").write_text(json.dumps({"prompt": "one", "answer": 1}) + "\n"
                                      + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(TypeError, match="mix chat messages and other values"):  # read as records, not as text lines
        load_prompt_table(str(tmp_path / "a.JSONL"))
    (tmp_path / "b.Json").write_text(json.dumps([{"messages": messages}]))
    assert load_prompt_table(str(tmp_path / "b.Json"))[0] == [messages]
    (tmp_path / "c.TXT").write_text("first\n\nsecond\n")
    assert load_prompt_table(str(tmp_path / "c.TXT"))[0] == ["first", "second"]


def test_prompt_files_without_a_known_extension_are_read_by_their_content(tmp_path):
    """No extension or another one: JSON lines are records, a JSON list is a list, other
    text is one prompt per line; streamed the same way. A .txt file of JSON records is
    read as its extension says (each line a prompt), with a warning naming the file."""
    import warnings

    from jaxppo.rollout.streams import read_prompt_records

    (tmp_path / "records").write_text(json.dumps({"prompt": "one", "answer": 1}) + "\n\n"
                                      + json.dumps({"prompt": "two", "answer": 2}) + "\n")
    assert load_prompt_table(str(tmp_path / "records")) == (["one", "two"], {"answer": [1, 2]})
    assert [r.record["prompt"] for r in read_prompt_records(str(tmp_path / "records"))] == ["one", "two"]
    (tmp_path / "list.data").write_text(json.dumps(["three", "four"], indent=1))
    assert load_prompt_table(str(tmp_path / "list.data"))[0] == ["three", "four"]
    (tmp_path / "plain.prompts").write_text("What is {x}?\n[not json\n")
    assert load_prompt_table(str(tmp_path / "plain.prompts"))[0] == ["What is {x}?", "[not json"]
    (tmp_path / "records.txt").write_text(json.dumps({"prompt": "five"}) + "\n")
    with pytest.warns(UserWarning, match=r"records.txt is read as a .txt file, .* Name it .jsonl to read the field"):
        assert load_prompt_table(str(tmp_path / "records.txt"))[0] == ['{"prompt": "five"}']
    with warnings.catch_warnings():  # plain text in a .txt file: no warning
        warnings.simplefilter("error")
        (tmp_path / "plain.txt").write_text("six\n{not a record}\n")
        assert load_prompt_table(str(tmp_path / "plain.txt"))[0] == ["six", "{not a record}"]
