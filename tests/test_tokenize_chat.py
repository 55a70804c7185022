"""`hybridpar tokenize --chat`: conversations rendered with the model's chat template, a loss
mask beside the ids, checked against transformers' own `apply_chat_template`.

The reference is transformers' ``return_assistant_tokens_mask=True`` on templates of three
families' layouts (ChatML as Qwen's, Llama 3's headers, Mistral's ``[INST]``) whose
``{% generation %}`` markers enclose what each assistant turn adds: hybridpar renders the
same templates without reading the markers (the prefix rule of `hybridpar.data.chat`), so
equal masks show the rule finds the turns a marked template names.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_tokenize import bpe_tokenizer

from hybridpar.cli import main
from hybridpar.data import CorpusError, open_tokens
from hybridpar.data.conversations import ChatFields
from hybridpar.data.shards import TokenFolderError
from hybridpar.data.tokenize import tokenize_corpus

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]",
            "[/INST]")

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
          "{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}{% else %}"
          "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}"
          "<|end_header_id|>\n\n{% if m.role == 'assistant' %}{% generation %}"
          "{{ m.content | trim }}<|eot_id|>{% endgeneration %}{% else %}{{ m.content | trim }}"
          "<|eot_id|>{% endif %}{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] "
           "{{ m.content }} [/INST]{% elif m.role == 'assistant' %}{% generation %} "
           "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}"
           "{{ raise_exception('only user and assistant roles') }}{% endif %}{% endfor %}")
FAMILIES = {  # template, bos, eos
    "chatml": (CHATML, None, "<|im_end|>"),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL, "<s>", "</s>"),
}

TALKS = [
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "What is a pipeline stage?"},
     {"role": "assistant", "content": "A slice of the model's layers on one device."},
     {"role": "user", "content": "And a micro-batch?"},
     {"role": "assistant", "content": "A slice of the batch — ça marche."}],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}],
    [{"role": "user", "content": "Two words?"},
     {"role": "assistant", "content": "Tensor parallel."},
     {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You're welcome!"}],
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return bpe_tokenizer(tmp_path_factory.mktemp("chat") / "tokenizer.json", specials=SPECIALS)


def model_folder(bpe: Path, root: Path, family: str) -> Path:
    """A tokenizer folder as save_pretrained writes it, the family's template inside."""
    from transformers import PreTrainedTokenizerFast

    template, bos, eos = FAMILIES[family]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(bpe), eos_token=eos,
                                  **({"bos_token": bos} if bos else {}))
    tok.chat_template = template
    tok.save_pretrained(root / family)
    return root / family


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                    encoding="utf-8")
    return path


def conversations(folder: Path) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of each document of the train split, in order."""
    out = []
    for shard in open_tokens(folder, verify=True).splits["train"]:
        start = 0
        for end in np.asarray(shard.ends, dtype=np.int64):
            out.append((np.asarray(shard.tokens[start:end]).tolist(),
                        np.asarray(shard.mask[start:end]).tolist()))
            start = int(end)
    return out


def tokenize(inputs, out: Path, tokenizer: Path, **options):
    return tokenize_corpus(inputs, out, tokenizer=tokenizer, val_fraction=0.0,
                           conversations=options.pop("fields", ChatFields()), **options)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ids_and_masks_equal_transformers_apply_chat_template(bpe, tmp_path, family):
    from transformers import AutoTokenizer

    folder = model_folder(bpe, tmp_path, family)
    talks = [t[1:] if family == "mistral" and t[0]["role"] == "system" else t for t in TALKS]
    done = tokenize([write_jsonl(tmp_path / "c.jsonl", [{"messages": t} for t in talks])],
                    tmp_path / "out", folder)
    reference = AutoTokenizer.from_pretrained(folder)
    eos = reference.convert_tokens_to_ids(FAMILIES[family][2])
    got = conversations(tmp_path / "out")
    assert len(got) == len(talks)
    for (ids, mask), talk in zip(got, talks):
        want = reference.apply_chat_template(talk, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        appended = ids[-1] == eos and want["input_ids"][-1:] != [eos]
        body = slice(0, len(ids) - appended)
        assert ids[body] == want["input_ids"] and mask[body] == want["assistant_masks"]
        assert sum(mask) > 0 and (not appended or mask[-1] == 0)
    assert done.meta["chat"]["counted"] == sum(sum(m) for _, m in got)
    assert done.meta["version"] == 2 and open_tokens(tmp_path / "out").masked


def test_the_last_turn_and_all_tokens_rules(bpe, tmp_path):
    folder = model_folder(bpe, tmp_path, "chatml")
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": TALKS[0]}])
    every = conversations(tokenize([data], tmp_path / "a", folder).folder)[0]
    last = conversations(tokenize([data], tmp_path / "l", folder, loss_mask="last").folder)[0]
    full = conversations(tokenize([data], tmp_path / "f", folder, loss_mask="all").folder)[0]
    assert every[0] == last[0] == full[0]
    assert full[1] == [1] * len(full[0])
    ones = np.flatnonzero(every[1])
    second = ones[ones > np.flatnonzero(np.diff(every[1]) < 0)[0]]     # the later turn
    assert np.flatnonzero(last[1]).tolist() == second.tolist()


def test_prompt_completion_pairs_are_a_user_and_an_assistant_turn(bpe, tmp_path):
    folder = model_folder(bpe, tmp_path, "llama3")
    pairs = [{"question": "2+2?", "answer": "4"}, {"question": "Capital of France?",
                                                     "answer": "Paris"}]
    talks = [{"messages": [{"role": "user", "content": p["question"]},
                           {"role": "assistant", "content": p["answer"]}]} for p in pairs]
    a = tokenize([write_jsonl(tmp_path / "p.jsonl", pairs)], tmp_path / "a", folder,
                 fields=ChatFields(prompt="question", completion="answer"))
    b = tokenize([write_jsonl(tmp_path / "m.jsonl", talks)], tmp_path / "b", folder)
    assert conversations(a.folder) == conversations(b.folder)


def test_parquet_and_a_datasets_arrow_file_read_as_jsonl(bpe, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder = model_folder(bpe, tmp_path, "chatml")
    table = pa.table({"messages": TALKS, "id": list(range(len(TALKS)))})
    pq.write_table(table, tmp_path / "c.parquet")
    arrow = tmp_path / "saved" / "data-00000-of-00001.arrow"     # save_to_disk's layout
    arrow.parent.mkdir()
    (arrow.parent / "state.json").write_text("{}")
    with pa.ipc.new_stream(str(arrow), table.schema) as writer:
        writer.write_table(table)
    want = conversations(tokenize([write_jsonl(tmp_path / "c.jsonl", [{"messages": t}
                                                                      for t in TALKS])],
                                  tmp_path / "j", folder).folder)
    assert conversations(tokenize([tmp_path / "c.parquet"], tmp_path / "p", folder).folder) \
        == want
    assert conversations(tokenize([arrow.parent], tmp_path / "a", folder).folder) == want


def test_workers_write_the_bytes_of_one_process_and_a_repeat_is_a_no_op(bpe, tmp_path):
    folder = model_folder(bpe, tmp_path, "chatml")
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": TALKS[i % 3]} for i in range(60)])
    one = tokenize([data], tmp_path / "one", folder, workers=1)
    two = tokenize([data], tmp_path / "two", folder, workers=2, batch_bytes=200)
    assert conversations(one.folder) == conversations(two.folder)
    assert one.meta["fingerprint"] == two.meta["fingerprint"]
    assert tokenize([data], tmp_path / "one", folder).up_to_date
    with pytest.raises(CorpusError, match=r"changed: .*chat"):
        tokenize([data], tmp_path / "one", folder, loss_mask="all")


def test_masks_split_into_shards_and_splits_with_their_ids(bpe, tmp_path):
    folder = model_folder(bpe, tmp_path, "chatml")
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": TALKS[i % 3]} for i in range(40)])
    whole = tokenize([data], tmp_path / "whole", folder)
    cut = tokenize_corpus([data], tmp_path / "cut", tokenizer=folder, val_fraction=0.25,
                          shard_tokens=300, conversations=ChatFields())
    assert len(cut.meta["splits"]["train"]["shards"]) > 1 and cut.meta["splits"]["val"]["documents"]
    opened = open_tokens(cut.folder, verify=True)
    pairs = []
    for split in ("train", "val"):
        for shard in opened.splits[split]:
            assert shard.mask is not None and len(shard.mask) == len(shard.tokens)
            ends = np.asarray(shard.ends, dtype=np.int64)
            for a, b in zip(np.concatenate([[0], ends[:-1]]), ends):
                pairs.append((np.asarray(shard.tokens[a:b]).tolist(),
                              np.asarray(shard.mask[a:b]).tolist()))
    assert sorted(pairs) == sorted(conversations(whole.folder))
    assert cut.meta["chat"]["counted"] == whole.meta["chat"]["counted"] == sum(
        s["counted"] for split in ("train", "val") for s in cut.meta["splits"][split]["shards"])


def test_the_command_says_what_the_loss_counts(bpe, tmp_path, capsys):
    folder = model_folder(bpe, tmp_path, "chatml")
    records = [{"messages": TALKS[1]}, {"messages": [{"role": "user", "content": "only me"}]}]
    data = write_jsonl(tmp_path / "c.jsonl", records)
    assert main(["tokenize", str(data), "-o", str(tmp_path / "out"), "--tokenizer",
                 str(folder), "--chat", "--quiet", "--val-fraction", "0"]) == 0
    out = capsys.readouterr().out
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert f"conversations: the loss counts {meta['chat']['counted']} of the " in out
    assert "1 conversation(s) without an assistant token skipped" in out
    assert meta["chat"]["dropped_without_assistant"] == 1 and meta["documents"] == 1


@pytest.mark.parametrize("record, message", [
    ({"text": "plain"}, r"c.jsonl:1: no field 'messages', nor 'prompt' and 'completion' "
                        r"\(its fields: 'text'\)"),
    ({"messages": [{"role": "robot", "content": "beep"}]},
     r"c.jsonl:1: message 0 has the role 'robot'; a message's role is one of system, user, "
     r"assistant, tool"),
    ({"messages": [{"role": "user"}]}, r"c.jsonl:1: message 0 \(user\) has no content"),
    ({"messages": []}, r"c.jsonl:1: field 'messages' is empty"),
    ({"prompt": "a", "completion": 3}, r"c.jsonl:1: field 'completion' is a int, not text"),
])
def test_a_bad_record_is_named_by_file_and_line(bpe, tmp_path, record, message):
    folder = model_folder(bpe, tmp_path, "chatml")
    with pytest.raises(CorpusError, match=message):
        tokenize([write_jsonl(tmp_path / "c.jsonl", [record])], tmp_path / "out", folder)
    assert not (tmp_path / "out").exists()


def test_template_errors_and_options_are_named(bpe, tmp_path):
    mistral = model_folder(bpe, tmp_path, "mistral")
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": TALKS[1]}, {"messages": TALKS[0]}])
    with pytest.raises(CorpusError, match=r"c.jsonl:2: the chat template fails to render this "
                                          r"conversation \(TemplateError: only user and "
                                          r"assistant roles\)"):
        tokenize([data], tmp_path / "out", mistral)
    lonely = write_jsonl(tmp_path / "u.jsonl", [{"messages": TALKS[1]},
                                                {"messages": TALKS[1][:1]}])
    with pytest.raises(CorpusError, match=r"u.jsonl:2: the conversation has no assistant "
                                          r"token .*--no-assistant skip"):
        tokenize([lonely], tmp_path / "out", mistral, no_assistant="error")
    with pytest.raises(CorpusError, match="no conversation has an assistant token"):
        tokenize([write_jsonl(tmp_path / "n.jsonl", [{"messages": TALKS[1][:1]}])],
                 tmp_path / "out", mistral)
    with pytest.raises(CorpusError, match=r"has no chat template .*--chat-template FILE"):
        tokenize([data], tmp_path / "out", bpe)
    with pytest.raises(CorpusError, match="conversations need a model's tokenizer"):
        tokenize([data], tmp_path / "out", "bytes")
    with pytest.raises(CorpusError, match=r"the chat template decides .*leave out --bos"):
        tokenize([data], tmp_path / "out", mistral, bos="yes")
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(CorpusError, match="a text file holds no conversations"):
        tokenize([tmp_path / "t.txt"], tmp_path / "out", mistral)
    assert not (tmp_path / "out").exists()


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_reason(bpe, tmp_path):
    # keeps only the last assistant turn's text, as templates that drop earlier reasoning do
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' "
                        "and not loop.last %}...{% else %}{{ m.content }}{% endif %}\n"
                        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": TALKS[2]}])
    with pytest.raises(CorpusError, match=r"c.jsonl:1: the chat template renders the "
                                          r"conversation up to message 1 differently .*"
                                          r"--loss-mask all"):
        tokenize([data], tmp_path / "out", bpe, chat_template=template, eos="<|endoftext|>")
    done = tokenize([data], tmp_path / "out", bpe, chat_template=template,
                    eos="<|endoftext|>", loss_mask="all")
    assert done.meta["chat"]["template_from"] == str(template)


def test_a_mask_that_does_not_match_its_ids_is_refused(bpe, tmp_path):
    folder = model_folder(bpe, tmp_path, "chatml")
    done = tokenize([write_jsonl(tmp_path / "c.jsonl", [{"messages": t} for t in TALKS])],
                    tmp_path / "out", folder)
    mask = done.folder / done.meta["splits"]["train"]["shards"][0]["mask"]
    bits = bytearray(mask.read_bytes())
    bits[0] ^= 1
    mask.write_bytes(bytes(bits))
    open_tokens(done.folder)                                   # sizes agree
    with pytest.raises(TokenFolderError, match=r"\.mask: its contents do not match "
                                               r"meta.json's mask_sha256"):
        open_tokens(done.folder, verify=True)
    mask.write_bytes(bytes(bits[:-1]))
    with pytest.raises(TokenFolderError, match=r"\.mask holds .* loss-mask bytes, one per "
                                               "token"):
        open_tokens(done.folder)
