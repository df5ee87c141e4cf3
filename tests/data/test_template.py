"""Chat templates (data/template.py): the G1 rendering of each record shape, which spans carry loss, span-wise
tokenization equal to the whole text's, and one-line refusals of bad templates and records."""

import json

import numpy as np
import pytest

from rwkvx_cli.data import ByteTokenizer, WorldTokenizer
from rwkvx_cli.data.template import clean, file_shape, load_template, parse_record
from rwkvx_cli.errors import UsageError
from tests.data.chats import conversation, pair

G1 = load_template("g1")


def test_g1_renders_a_conversation_and_only_the_replies_carry_loss():
    turns = [("system", "Be brief.\r\n\r\n\nReally."), ("user", "  hi\n\nthere "), ("assistant", "Hello!"),
             ("user", "2+2?"), ("assistant", "4.\n\nDone")]
    spans = G1.spans(turns)
    assert spans == [
        ("System: Be brief.\nReally.\n\nUser: hi\nthere\n\nAssistant:", False),  # cleaned as G1 says
        (" Hello!\n\n", True),  # the reply's space, the reply and its turn's end
        ("User: 2+2?\n\nAssistant:", False),
        (" 4.\n\nDone\n\n", True),  # a reply is not cleaned
    ]
    assert clean("a\r\n\r\nb\n\n\nc \n") == "a\nb\nc"


def test_each_record_shape_renders_through_the_template():
    msgs = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "id": 3}
    assert G1.record_spans(msgs, "messages", "text") == [("User: q\n\nAssistant:", False), (" a\n\n", True)]
    assert G1.record_spans({"prompt": "q", "response": "a"}, "prompt", "text") == G1.spans(
        [("user", "q"), ("assistant", "a")]
    )
    assert G1.record_spans({"body": "plain", "id": 1}, "text", "body") == [("plain", True)]


@pytest.mark.parametrize(
    "record, shape, reason",
    [
        ({"text": "x"}, "messages", "a document, in a file of conversations (its first record's shape)"),
        ({"messages": []}, "prompt", 'a conversation ("messages"), in a file of prompt/response pairs'),
        ({"other": 1}, "text", 'a record without "messages", "prompt"/"response" or "text"'),
        ({"messages": "hi"}, "messages", '"messages" must be a non-empty list'),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "message 1: role 'tool' is not one of the"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages", "message 1 content must be a string"),
        ({"messages": ["hi"]}, "messages", 'message 1 is not a {"role", "content"} object'),
        ({"prompt": "q"}, "prompt", '"response" must be a string'),
        ({"prompt": "q", "response": "\ud800"}, "prompt", "response contains an unpaired surrogate \\ud800"),
    ],
)
def test_a_bad_record_says_why_in_one_line(record, shape, reason):
    with pytest.raises(ValueError) as e:
        G1.record_spans(record, shape, "text")
    assert reason in str(e.value) and "\n" not in str(e.value)


def _whole_and_spans(tok, spans, eod):
    """The ids of the whole rendered text and the span-wise ids (each span encoded alone), each with the eod."""
    whole = tok.encode("".join(t for t, _ in spans)) + [eod]
    parts = [i for t, _ in spans for i in tok.encode(t)] + [eod]
    return whole, parts


@pytest.mark.parametrize("tok", [WorldTokenizer(), ByteTokenizer()], ids=["world", "byte"])
def test_span_wise_tokens_equal_the_whole_texts_tokens(tok):
    """The mask comes from spans tokenized one at a time; with World and byte tokens that is exactly the id
    sequence of the whole rendered conversation (G1: a span ends at "Assistant:|␣..." or "...\\n\\n|User:", and no
    World token holds ": " or a newline followed by anything but whitespace)."""
    rng = np.random.default_rng(7)
    records = [conversation(rng) for _ in range(300)] + [pair(rng) for _ in range(100)]
    checked = 0
    for r in records:
        shape = "messages" if "messages" in r else "prompt"
        whole, parts = _whole_and_spans(tok, G1.record_spans(r, shape, "text"), tok.eod_id)
        assert whole == parts, r
        checked += len(whole)
    assert checked > 10_000
    if isinstance(tok, WorldTokenizer):  # the two facts the argument rests on, read from the vocabulary
        table = tok.table
        assert not any(b": " in t or b":\t" in t or b":\n" in t for t in table)
        assert not any(i + 1 < len(t) and t[i] == 10 and t[i + 1] not in b" \t\n\r\x0b\x0c"
                       for t in table for i in range(len(t)))


def test_world_ids_of_the_g1_markers():
    """The ids RWKV-LM's G1 models read (research memo, section 1): the template spells them exactly."""
    w = WorldTokenizer()
    spans = G1.spans([("user", "hi"), ("assistant", "hello")])
    assert [w.encode(t) for t, _ in spans] == [[24281, 59, 4571, 261, 5585, 41693, 59], [38685, 261]]


def test_a_template_file_is_data(tmp_path):
    path = tmp_path / "chatml.yaml"
    path.write_text(
        "name: chatml\nroles:\n  user: {prefix: \"<|im_start|>user\\n\", loss: false}\n"
        "  assistant: {prefix: \"<|im_start|>assistant\\n\", loss: true}\n"
        "turn_end: \"<|im_end|>\\n\"\nprompt: user\nresponse: assistant\n"
    )
    t = load_template(path)
    assert t.name == "chatml" and t.sha256 != G1.sha256
    assert t.spans([("user", "q"), ("assistant", "a")]) == [
        ("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", False),
        ("a<|im_end|>\n", True),
    ]
    assert load_template(path).sha256 == t.sha256  # the identity is the content, not the path
    json_path = tmp_path / "g1.json"
    json_path.write_text(json.dumps(G1.as_dict()))
    assert load_template(json_path).sha256 == G1.sha256


@pytest.mark.parametrize(
    "text, message",
    [
        ("- a list", "a template is a mapping"),
        ("name: x\nroles: {user: {prefix: U, loss: false}}", "no role carries loss"),
        ("name: x\nroles: {a: {prefix: A, loss: yes please}}", "role a: loss (required) and clean must be"),
        ("name: x\nroles: {a: {loss: true}}\nturn_end: 3", "turn_end must be a string"),
        ("name: x\nroles: {a: {loss: true}}\nend: \"\\n\"", "end is '\\n': a conversation ends with"),
        ("name: x\nroles: {a: {loss: true}}\nprompt: user", "prompt names the role 'user', which is not one"),
        ("name: x\nroles: {a: {loss: true, colour: red}}", "role a: unknown key 'colour'"),
        ("name: x\nrole: {}", "unknown key 'role'"),
        ("name: [unclosed", "is not valid YAML or JSON"),
    ],
)
def test_a_bad_template_is_one_line(tmp_path, text, message):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as e:
        load_template(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_template_name_lists_the_shipped_ones():
    with pytest.raises(UsageError, match=r"template 'g2' is neither a template name \(g1\) nor a file"):
        load_template("g2")


def test_a_file_has_the_shape_of_its_first_record(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('\nnot json\n[1]\n{"prompt": "q", "response": "a"}\n{"text": "t"}\n')
    assert file_shape(p, "text") == "prompt"  # blank, bad and non-object lines are read past
    p.write_text('{"body": "x"}\n')
    assert file_shape(p, "body") == "text" and file_shape(p, "text") == "text"
    assert file_shape(tmp_path / "a.txt", "text") == "text"
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_record(b"{")
