"""`llmopt serve` driven by the `openai` SDK through vLLM's OpenAI surface: n choices (seeds
seed + i, the prompt's KV blocks shared), batched prompts, echo, logprobs / top_logprobs
(equal to the model's own log-softmax), penalties, min_p, logit_bias, content-part messages,
response_format (JSON schema outputs always parse and validate), tools (tool_choice required /
named through constrained decoding, auto with the template's parser), vLLM's tokenizer
endpoints, and a 400 naming every field the server does not implement.

The model is a small random Llama with SmolLM2's real tokenizer and Qwen2.5-Instruct's real
chat template (tests/fixtures/chat_templates, from llama.cpp's models/templates, which copies
the models' Hub tokenizer configs; the vendored llama.cpp of llama-cpp-python 0.3.36), so the
template teaches the Hermes <tool_call> format.
"""

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from llmopt.infer.batch import EngineConfig, SamplingParams, ServingEngine
from llmopt.infer.generate import generate
from llmopt.models.loading import load_model, load_tokenizer
from llmopt.models.tokenizer import Tokenizer
from tests.paths import FIXTURES
from tests.serve_fixtures import Server
from tests.tiny_models import save_model_dir, smol_config

TEMPLATES = FIXTURES / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,  # else a random model writes extra keys forever
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def _qwen_template_tokenizer() -> Tokenizer:
    smol = load_tokenizer("smollm2-135m")
    return Tokenizer(
        smol.backend,
        bos_token_id=smol.bos_token_id,
        eos_token_id=smol.eos_token_id,  # <|im_end|>: the turn end the Qwen template writes
        chat_template=(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(),
        add_bos=smol.add_bos,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = smol_config("small", max_seq_len=1024, bos_token_id=1, eos_token_id=2)
    out = tmp_path_factory.mktemp("openai-model")
    return save_model_dir(out, cfg, seed=0, tokenizer=_qwen_template_tokenizer())


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(model_dir, "--kv-blocks", "512", "--block-size", "16")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@torch.no_grad()
def _log_softmax(model, ids):
    return model(torch.tensor([ids]))[0].float().log_softmax(-1)


# ---- n, seeds, batched prompts ----
def test_n_choices_take_vllm_seeds_and_share_the_prompt_blocks(server, client, tok):
    prompt = "Choices share " + " ".join(["word"] * 40)
    ids = tok.encode(prompt)
    blocks = (len(ids) - 1) // 16
    before = server.metric("llmopt_prefix_cache_hit_blocks_total")
    r = client.completions.create(
        model="tiny", prompt=prompt, n=3, max_tokens=6, temperature=1.0, seed=11
    )
    # the first choice computed the prompt; the two others read its full blocks from the cache
    assert server.metric("llmopt_prefix_cache_hit_blocks_total") - before == 2 * blocks >= 4
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 18
    singles = [
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=11 + i
        )
        .choices[0]
        .text
        for i in range(3)
    ]
    assert [c.text for c in r.choices] == singles  # choice i samples with seed + i, as vLLM
    assert len(set(singles)) == 3


def test_batched_prompts_strings_and_token_ids(client, tok):
    prompts = ["The capital of France is", "One, two, three,"]
    args = dict(model="tiny", n=2, max_tokens=5, temperature=0.8, seed=5)
    by_text = client.completions.create(prompt=prompts, **args)
    by_ids = client.completions.create(prompt=[tok.encode(p) for p in prompts], **args)
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    for p, prompt in enumerate(prompts):
        for i in range(2):
            single = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=5, temperature=0.8, seed=5 + i
            )
            assert by_text.choices[2 * p + i].text == single.choices[0].text
    assert by_text.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert by_text.usage.completion_tokens == 20
    stream = client.completions.create(
        prompt=prompts, stream=True, stream_options={"include_usage": True}, **args
    )
    texts, reasons, usage = ["", "", "", ""], [None] * 4, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in by_text.choices]
    assert reasons == [c.finish_reason for c in by_text.choices]
    assert usage.completion_tokens == 20


# ---- logprobs and echo ----
def test_completion_logprobs_and_echo_equal_the_models_log_softmax(client, tok, model):
    prompt = "In the beginning God created"
    ids = tok.encode(prompt)
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True
    )
    choice, lp = r.choices[0], r.choices[0].logprobs
    all_ids = ids + generate(model, ids, max_new_tokens=4)
    assert choice.text == prompt + tok.decode(all_ids[len(ids) :])
    assert lp.tokens == [tok.decode([t]) for t in all_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it
    ref = _log_softmax(model, all_ids)
    for pos in range(1, len(all_ids)):
        row = ref[pos - 1]
        assert lp.token_logprobs[pos] == pytest.approx(row[all_ids[pos]].item(), abs=1e-4)
        best = row.topk(3)
        expect = {tok.decode([all_ids[pos]]): row[all_ids[pos]].item()}  # the token, then the best
        for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            expect.setdefault(tok.decode([t]), v)
        assert lp.top_logprobs[pos] == pytest.approx(expect, abs=1e-4)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    # max_tokens=0 with echo: the prompt and its logprobs only (lm-eval's loglikelihood)
    only = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(
        lp.token_logprobs[: len(ids)], abs=1e-5
    )
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 must be >= 1"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


def test_echo_and_logprobs_stream(client):
    args = dict(model="tiny", prompt="Hello there", max_tokens=5, temperature=0, logprobs=2)
    whole = client.completions.create(echo=True, **args).choices[0]
    tokens, logprobs, text = [], [], ""
    for chunk in client.completions.create(echo=True, stream=True, **args):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert logprobs == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)


def test_chat_logprobs_and_top_logprobs(client, tok, model):
    messages = [{"role": "user", "content": "Name a colour"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    prompt = tok.encode(tok.apply_chat_template(messages))
    out = generate(model, prompt, max_new_tokens=5)
    assert [e.token for e in content] == [tok.decode([t]) for t in out]
    ref = _log_softmax(model, prompt + out)
    for j, entry in enumerate(content):
        row = ref[len(prompt) - 1 + j]
        assert entry.logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        best = row.topk(2)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in best.indices]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            best.values.tolist(), abs=1e-4
        )
    assert "".join(e.token for e in content) == r.choices[0].message.content
    bare = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True
    )
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs': true"):
        client.chat.completions.create(model="tiny", messages=messages, top_logprobs=2)


# ---- penalties, min_p, logit_bias ----
@pytest.mark.parametrize(
    ("fields", "extra"),
    [
        ({"frequency_penalty": 1.5}, {}),
        ({"presence_penalty": 1.2}, {}),
        ({}, {"repetition_penalty": 1.7}),
        ({"frequency_penalty": -0.5, "presence_penalty": 0.5}, {"repetition_penalty": 0.8}),
        ({"temperature": 1.3, "seed": 4}, {"min_p": 0.9}),
    ],
)
def test_penalties_and_min_p_decode_as_the_engine_does(client, model, tok, fields, extra):
    prompt = "the the the the the the"
    args = {"temperature": 0} | fields
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, extra_body=extra, **args
    )
    params = SamplingParams(max_tokens=10, **(args | extra))
    engine = ServingEngine(
        model,
        EngineConfig(num_blocks=64, runner="eager"),
        eos_token_id=tok.eos_token_id,
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )
    [ref] = engine.generate([tok.encode(prompt)], params)
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    plain = dict(params.__dict__) | {"frequency_penalty": 0.0, "presence_penalty": 0.0}
    plain |= {"repetition_penalty": 1.0, "min_p": 0.0}
    plain = {k: v for k, v in plain.items() if not k.startswith("_")}
    [unpenalized] = engine.generate([tok.encode(prompt)], SamplingParams(**plain))
    assert ref != unpenalized  # the field changed the output: it was not ignored


def test_logit_bias_forces_a_token(client, tok):
    token = tok.encode(" yes")[0]
    r = client.completions.create(
        model="tiny", prompt="Say", max_tokens=4, temperature=1.0, logit_bias={str(token): 100}
    )
    assert r.choices[0].text == " yes" * 4
    with pytest.raises(openai.BadRequestError, match=r"logit_bias token ids \[99999\]"):
        client.completions.create(model="tiny", prompt="Say", logit_bias={"99999": 1})


# ---- messages ----
def test_content_parts_are_joined_and_non_text_parts_refused(client):
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]
    args = dict(model="tiny", max_tokens=6, temperature=0)
    a = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **args)
    b = client.chat.completions.create(messages=[{"role": "user", "content": "Say\nhi"}], **args)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            messages=[{"role": "user", "content": [parts[0], image]}], **args
        )
    assert (
        "messages[0].content[1]: content part type 'image_url' is not supported"
        in (err.value.body["message"])
    )


# ---- response_format ----
def test_json_schema_outputs_always_parse_and_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A person as JSON"}],
        response_format=fmt,
        n=6,
        temperature=1.0,
        seed=0,
        max_tokens=300,
    )
    assert len(r.choices) == 6
    outputs = set()
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        outputs.add(choice.message.content)
    assert len(outputs) == 6  # six different samples, each valid
    greedy = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A person as JSON"}],
        response_format=fmt,
        temperature=0,
        max_tokens=300,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in greedy if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    # any JSON object: a random model's strings may run to max_tokens; what stops parses
    free = client.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=100,
        temperature=1.0,
        seed=1,
        n=8,
        extra_body={"response_format": {"type": "json_object"}},  # vLLM's completions extra
    )
    stopped = [c.text for c in free.choices if c.finish_reason == "stop"]
    assert len(stopped) >= 2 and all(isinstance(json.loads(t), dict) for t in stopped)
    assert all(c.text.startswith("{") for c in free.choices)
    with pytest.raises(openai.BadRequestError) as err:
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], response_format=bad
        )
    assert err.value.body["param"] == "response_format"
    assert "invalid json schema" in err.value.body["message"]


# ---- tools ----
def _ask(client, **kw):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"max_tokens": 200} | kw
    return client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER, TIME], **kw
    )


def _validate_call(call):
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


def test_tool_choice_required_and_named_give_valid_calls(client):
    for seed in range(3):  # one call each (parallel_tool_calls=false bounds the array)
        r = _ask(
            client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        _validate_call(call)
    # parallel calls: an array with no bound, which a random model may grow to max_tokens;
    # every answer that finished is a list of valid calls
    finished = 0
    for seed in range(4):
        choice = _ask(client, tool_choice="required", temperature=1.0, seed=seed).choices[0]
        if choice.finish_reason == "length":
            assert choice.message.tool_calls is None
            continue
        assert choice.finish_reason == "tool_calls"
        finished += 1
        for call in choice.message.tool_calls:
            _validate_call(call)
    assert finished >= 1
    named = _ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "stop"
    _validate_call(call)
    whole = _ask(client, tool_choice="required", parallel_tool_calls=False, temperature=0)
    stream = _ask(
        client, tool_choice="required", parallel_tool_calls=False, temperature=0, stream=True
    )
    calls, reason = [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        calls += delta.tool_calls or []
        reason = chunk.choices[0].finish_reason or reason
    assert reason == whole.choices[0].finish_reason == "tool_calls"
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (i, c.function.name, c.function.arguments)
        for i, c in enumerate(whole.choices[0].message.tool_calls)
    ]


def test_tool_choice_auto_renders_the_tools_and_parses_the_answer(client, tok):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = _ask(client, temperature=0, max_tokens=8)
    prompt = tok.apply_chat_template(messages, tools=[WEATHER, TIME])
    assert "<tools>" in prompt and r.usage.prompt_tokens == len(tok.encode(prompt))
    choice = r.choices[0]  # a random model writes no <tool_call>: the text is content
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    # a conversation that went through a tool call and its result
    history = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=4, temperature=0
    )
    rendered = tok.apply_chat_template(
        [
            messages[0],
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
        ],
        tools=[WEATHER],
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered))


@pytest.mark.slow
def test_tools_need_a_template_with_a_tool_format_for_auto(tmp_path):
    srv = Server("smollm2-135m", "--kv-blocks", "64")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            _ask(client)
        assert err.value.body["param"] == "tools"
        assert "chat template that teaches a tool-call format" in err.value.body["message"]
        # constrained decoding needs no template support, on the real SmolLM2-135M
        r = _ask(client, tool_choice="required", temperature=0, max_tokens=120)
        for call in r.choices[0].message.tool_calls:
            _validate_call(call)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        for seed in range(3):
            out = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Describe a person named Ada as JSON."}],
                response_format=fmt,
                temperature=0.7,
                seed=seed,
                max_tokens=120,
            )
            jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    finally:
        srv.stop()


# ---- the tokenizer endpoints lm-eval's local-completions detects ----
def test_tokenizer_endpoints(server, tok):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == tok.chat_template
    chat = httpx.post(
        server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["tokens"] == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    )
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---- every field the server does not implement: a 400 naming it ----
@pytest.mark.parametrize(
    ("chat", "extra", "field"),
    [
        (False, {"suffix": "!"}, "suffix"),
        (False, {"best_of": 3}, "best_of"),
        (False, {"guided_json": {"type": "object"}}, "guided_json"),
        (False, {"prompt_logprobs": 1}, "prompt_logprobs"),
        (False, {"min_tokens": 3}, "min_tokens"),
        (False, {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        (False, {"stream_options": {"include_usage": True}}, "stream_options"),
        (True, {"echo": True}, "echo"),
        (True, {"functions": [{"name": "f"}]}, "functions"),
        (True, {"audio": {"voice": "alloy"}}, "audio"),
        (True, {"store": True}, "store"),
        (True, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        (True, {"response_format": {"type": "structural_tag"}}, "response_format"),
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (True, {"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_unimplemented_fields_get_a_400_naming_them(client, chat, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=2, extra_body=extra
            )
        else:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)
    assert (
        err.value.body["param"] == field
        and f"'{field}'" in err.value.body["message"]
        or (field == "response_format" and "structural_tag" in err.value.body["message"])
    )


def test_noop_values_of_unimplemented_fields_are_accepted(client):
    r = client.completions.create(
        model="tiny", prompt="hi", max_tokens=2, extra_body={"suffix": "", "best_of": 1}
    )
    assert r.choices[0].finish_reason in ("length", "stop")
