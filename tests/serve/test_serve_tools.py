"""Tool-call parsing: each parser reads back exactly the calls its chat template writes (the
real Qwen2.5 and Llama-3.1 templates render an assistant turn with tool calls; the parser
recovers them), partial output streams only what cannot become a call, and a chat choice is
assembled whole and streamed into the same content, tool calls and finish reason."""

import asyncio
import json

import pytest

from llmopt.infer.batch import StepOutput
from llmopt.models.loading import load_tokenizer
from llmopt.models.tokenizer import Tokenizer
from llmopt.serve.choices import Choices
from llmopt.serve.protocol import RequestParser
from llmopt.serve.responses import TokenText
from llmopt.serve.tools import HermesParser, Llama3JsonParser, parser_for_template
from tests.paths import FIXTURES

TEMPLATES = FIXTURES / "chat_templates"
CALLS = [
    ("get_weather", {"city": "Zürich", "unit": "celsius"}),
    ("get_time", {"zone": -3, "dst": False, "note": 'say "hi"'}),
]


def _tokenizer(template: str) -> Tokenizer:
    smol = load_tokenizer("smollm2-135m")
    return Tokenizer(
        smol.backend,
        bos_token_id=smol.bos_token_id,
        eos_token_id=smol.eos_token_id,
        chat_template=(TEMPLATES / template).read_text(),
    )


def _assistant_turn(template: str, calls, start: str, end: str) -> str:
    """What the template writes for an assistant turn that made `calls` (the format it
    teaches the model), cut out of the rendered conversation."""
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
            ],
        },
    ]
    text = _tokenizer(template).apply_chat_template(messages, add_generation_prompt=False)
    turn = text[text.rindex(start) + len(start) :]
    return turn[: turn.index(end)]


def test_hermes_parser_reads_back_what_the_qwen_template_writes():
    turn = _assistant_turn(
        "Qwen-Qwen2.5-7B-Instruct.jinja", CALLS, "<|im_start|>assistant", "<|im_end|>"
    )
    assert turn.count("<tool_call>") == 2
    content, calls = HermesParser().parse(turn)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    content, calls = HermesParser().parse("Let me check." + turn)
    assert content == "Let me check.\n" and len(calls) == 2
    broken = "Sure <tool_call>\n{not json}\n</tool_call>"
    assert HermesParser().parse(broken) == (broken, [])  # not a call: the text stays content
    assert HermesParser().parse("plain answer") == ("plain answer", [])


def test_llama3_parser_reads_back_what_the_llama31_template_writes():
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    turn = _assistant_turn(
        "meta-llama-Llama-3.1-8B-Instruct.jinja", CALLS[:1], header, "<|eot_id|>"
    )
    assert turn.startswith('{"name": "get_weather", "parameters": ')
    content, calls = Llama3JsonParser().parse(turn)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[:1]
    two = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)
    assert [c.name for c in Llama3JsonParser().parse("<|python_tag|>" + two)[1]] == [
        "get_weather",
        "get_time",
    ]
    for text in ("The weather is fine.", '{"name": "f", "parameters": {}} and more', "{oops"):
        assert Llama3JsonParser().parse(text) == (text, [])


def test_parser_follows_the_template():
    assert (
        parser_for_template((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()).name
        == "hermes"
    )
    llama = (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    assert parser_for_template(llama).name == "llama3_json"
    assert parser_for_template(load_tokenizer("smollm2-135m").chat_template) is None
    assert parser_for_template(None) is None


def test_streamable_holds_back_what_may_become_a_call():
    hermes, llama = HermesParser(), Llama3JsonParser()
    assert hermes.streamable("Checking <tool_c") == "Checking "
    assert hermes.streamable("Checking <tool_call>{") == "Checking "
    assert hermes.streamable("a < b") == "a < b"
    assert llama.streamable("  ") == "" and llama.streamable('{"name"') == ""
    assert llama.streamable("Hello") == "Hello"


def _outputs(tok, text: str, pieces: int) -> list[StepOutput]:
    """The engine's outputs for `text` split over `pieces` steps (tokens and cumulative text)."""
    ids = tok.encode(text)
    cuts = [len(ids) * k // pieces for k in range(pieces + 1)]
    outs = []
    for k in range(pieces):
        done = k == pieces - 1
        seen = tok.decode(ids[: cuts[k + 1]])
        outs.append(
            StepOutput(
                "r",
                ids[cuts[k] : cuts[k + 1]],
                done,
                "stop" if done else None,
                seen,
                5,
                cuts[k + 1],
            )
        )
    return outs


@pytest.mark.parametrize(
    "text",
    [
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "No tools needed: it is 3 < 4.",
    ],
)
def test_chat_choice_whole_and_streamed_agree(text):
    tok = _tokenizer("Qwen-Qwen2.5-7B-Instruct.jinja")
    parser = RequestParser(tok, served_name="m", context=4096, vocab_size=49152)
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    parsed = parser(body, chat=True)
    assert parsed.tool_parser.name == "hermes"

    async def run():
        whole = Choices(None, "chatcmpl-x", parsed, TokenText(tok))
        streamed = Choices(None, "chatcmpl-x", parsed, TokenText(tok))
        deltas = []
        for out in _outputs(tok, text, 6):
            whole.absorb(0, out)
            streamed.absorb(0, out)
            deltas += streamed.chat_deltas(0, out)
        return whole.chat(0), deltas

    choice, deltas = asyncio.run(run())
    content = "".join(d["delta"].get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert (content or None) == choice["message"]["content"]
    assert [c["function"] for c in calls] == [
        c["function"] for c in choice["message"].get("tool_calls", [])
    ]
    assert deltas[-1]["finish_reason"] == choice["finish_reason"]
    if "<tool_call>" in text:
        assert choice["finish_reason"] == "tool_calls" and content == "Let me look.\n"
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        assert calls[0]["index"] == 0 and calls[0]["id"].startswith("chatcmpl-tool-")
    else:
        assert choice["finish_reason"] == "stop" and content == text and not calls


def test_constrained_tool_schemas():
    from llmopt.serve.tools import ToolRequest

    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}},
             {"type": "function", "function": {"name": "g"}}]  # fmt: skip
    required = ToolRequest(tools, "required").schema()
    assert required["minItems"] == 1 and "maxItems" not in required
    options = required["items"]["anyOf"]
    assert [o["properties"]["name"] for o in options] == [{"const": "f"}, {"const": "g"}]
    assert options[0]["properties"]["parameters"] == params
    assert options[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert ToolRequest(tools, "required", parallel=False).schema()["maxItems"] == 1
    assert ToolRequest(tools, "named", "f").schema() == params
    assert ToolRequest(tools, "auto").schema() is None
    calls = ToolRequest(tools, "required").calls('[{"name": "g", "parameters": {}}]')
    assert [(c.name, c.arguments) for c in calls] == [("g", "{}")]
    assert ToolRequest(tools, "required").calls('[{"name": "g", "param') == []  # cut short
    assert ToolRequest(tools, "named", "f").calls('{"q" : "x"}')[0].arguments == '{"q": "x"}'
