"""Chat templates render exactly as transformers' `apply_chat_template(tokenize=False)`, on the
real templates of every registered architecture's models and on tool-calling templates."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from llmopt.models.chat_template import ChatTemplateError, render_chat
from llmopt.models.tokenizer import Tokenizer
from tests.paths import FIXTURES

TEMPLATES = FIXTURES / "chat_templates"
# template file -> (bos, eos) as the model's tokenizer_config.json names them
SPECIALS = {
    "HuggingFaceTB-SmolLM2-135M-Instruct": ("<|im_start|>", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "<|im_end|>"),
    "Qwen-Qwen3-0.6B": (None, "<|im_end|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "deepseek-ai-DeepSeek-V3.1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "Qwen3-Coder": (None, "<|im_end|>"),
}
# registered architecture -> a template of its models above
ARCHITECTURES = {
    "llama": "meta-llama-Llama-3.1-8B-Instruct",
    "qwen2": "Qwen-Qwen2.5-7B-Instruct",
    "qwen3": "Qwen-Qwen3-0.6B",
    "mistral": "mistralai-Mistral-Nemo-Instruct-2407",
    "phi3": "microsoft-Phi-3.5-mini-instruct",
    "gemma2": "google-gemma-2-2b-it",
    "qwen3_moe": "Qwen3-Coder",
    "deepseek_v3": "deepseek-ai-DeepSeek-V3.1",
}
# registered architectures whose models' templates are not in reach offline (llama.cpp's
# tree, the only source here, holds no Mixtral or Qwen2-MoE template): said, not faked
NO_TEMPLATE_HERE = {
    "mixtral": "Mixtral-8x7B-Instruct's [INST] template: not in llama.cpp's models/templates",
    "qwen2_moe": "Qwen1.5-MoE / Qwen2-57B-A14B chat templates: not in llama.cpp's models/templates",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <b>now</b> & later — in °C",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "e.g. Zürich"},
                    "days": {"type": "integer", "enum": [1, 2, 3]},
                },
                "required": ["city"],
            },
        },
    }
]
CHATS = {
    "plain": [
        {"role": "user", "content": 'Héllo <b>there</b> & "friends" — 日本語?'},
        {"role": "assistant", "content": "Hi! 🦙 'quoted'"},
        {"role": "user", "content": "Two more\nlines\n"},
    ],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    "tools": [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call0abcd",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}},
                }
            ],
        },
        {
            "role": "tool",
            "name": "get_weather",
            "tool_call_id": "call0abcd",
            "content": '{"t": 21}',
        },
    ],
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "3+3?"},
    ],
}


def hf_tokenizer(name: str, template: str):
    from transformers import PreTrainedTokenizerFast

    bos, eos = SPECIALS[name]
    vocab = {t: i for i, t in enumerate(["<unk>", *(t for t in (bos, eos) if t)])}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, chat_template=template
    )
    ours = Tokenizer(
        backend,
        bos_token_id=vocab.get(bos),
        eos_token_id=vocab.get(eos),
        chat_template=template,
    )
    return hf, ours


def both(name: str, chat: str, **kwargs):
    """(transformers' text or its exception type, ours or our exception)"""
    import jinja2

    template = (TEMPLATES / f"{name}.jinja").read_text()
    hf, ours = hf_tokenizer(name, template)
    messages = CHATS[chat]
    try:
        expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    except jinja2.exceptions.TemplateError as exc:
        with pytest.raises(ChatTemplateError, match=str(exc)[:40].replace("(", r"\(")):
            ours.apply_chat_template(messages, **kwargs)
        return None
    return expected, ours.apply_chat_template(messages, **kwargs)


def test_every_registered_architecture_has_a_template_here():
    from llmopt.models.spec import registered_architectures

    assert set(registered_architectures()) == set(ARCHITECTURES) | set(NO_TEMPLATE_HERE)


@pytest.mark.parametrize("name", sorted(SPECIALS))
@pytest.mark.parametrize("chat", ["plain", "system", "reasoning"])
@pytest.mark.parametrize("prompt", [True, False])
def test_rendering_equals_transformers(name, chat, prompt):
    result = both(name, chat, add_generation_prompt=prompt)
    if result is not None:  # else both refused alike (e.g. Gemma 2 has no system role)
        assert result[1] == result[0]


@pytest.mark.parametrize(
    "name",
    [
        "meta-llama-Llama-3.1-8B-Instruct",
        "meta-llama-Llama-3.2-3B-Instruct",
        "Qwen-Qwen2.5-7B-Instruct",
        "Qwen-Qwen3-0.6B",
        "mistralai-Mistral-Nemo-Instruct-2407",
        "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    ],
)
def test_tool_calling_templates_equal_transformers(name):
    expected, ours = both(name, "tools", tools=TOOLS, add_generation_prompt=True)
    assert ours == expected
    assert "Zürich" in ours  # tojson keeps non-ASCII, and no HTML escaping of <b> or &
    assert "<b>now</b> &" in ours or name.startswith("Cohere") and "get_weather" in ours


def test_none_values_are_dropped_as_transformers_drops_them():
    template = "{% for m in messages %}{{ m.content is defined }}{{ m | tojson }}{% endfor %}"
    hf, ours = hf_tokenizer("Qwen-Qwen3-0.6B", template)
    chat = [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]
    expected = hf.apply_chat_template(chat, tokenize=False)
    assert ours.apply_chat_template(chat, False) == expected
    assert expected.startswith("False")


def test_template_variables_and_continuing_a_message():
    expected, ours = both(
        "Qwen-Qwen3-0.6B", "reasoning", add_generation_prompt=True, enable_thinking=False
    )
    assert ours == expected and "<think>\n\n</think>" in ours
    name = "HuggingFaceTB-SmolLM2-135M-Instruct"
    hf, tok = hf_tokenizer(name, (TEMPLATES / f"{name}.jinja").read_text())
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    expected = hf.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert tok.apply_chat_template(chat, False, continue_final_message=True) == expected
    assert expected.endswith("The answer is")


def test_jinja_extensions_transformers_enables():
    """{% generation %}, {% break %}/{% continue %}, tojson options, namespace, dict,
    strftime_now, raise_exception: the same text as transformers' environment."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
        "{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}|"
        "{{ dict(a=1, b='é<&>') | tojson(indent=2, sort_keys=True) }}|"
        "{{ m | tojson(separators=(',', ':')) }}{% endfor %}"
        "{{ ns.n }}{{ strftime_now('%Y') | length }}"
    )
    messages = [
        {"role": "user", "content": "a<b>&é"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "ok"},
        {"role": "stop", "content": "y"},
        {"role": "user", "content": "never"},
    ]
    expected = render_jinja_template([messages], chat_template=template)[0][0]
    assert render_chat(template, messages) == expected
    assert '"a<b>&é"' in expected and "never" not in expected
    with pytest.raises(
        ChatTemplateError, match="chat template fails: TemplateError: no system role"
    ):
        render_chat("{{ raise_exception('no system role') }}", messages)
    with pytest.raises(ChatTemplateError, match="underscore"):
        render_chat("{% set ns = namespace(_x=1) %}", messages)
    with pytest.raises(ChatTemplateError, match=r"does not compile \(line 1\)"):
        render_chat("{% for %}", messages)


def test_bad_messages_are_refused():
    tok = hf_tokenizer("Qwen-Qwen3-0.6B", "{{ messages }}")[1]
    with pytest.raises(ValueError, match="needs a 'role' key"):
        tok.apply_chat_template([{"content": "x"}])
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])


def test_eos_list_from_generation_config(tmp_path):
    """Llama 3's generation_config.json lists <|end_of_text|>, <|eom_id|>, <|eot_id|>: all of
    them end generation; the tokenizer's own EOS comes first."""
    import json

    vocab = {
        t: i
        for i, t in enumerate(
            ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
        )
    }
    Backend(models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3, 4]}))
    tok = Tokenizer.from_directory(tmp_path)
    assert tok.eos_token_id == 4 and tok.eos_token_ids == (4, 2, 3)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "x"]}))
    with pytest.raises(ValueError, match=r"eos_token_id = \[2, 'x'\] must be an integer or a list"):
        Tokenizer.from_directory(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_directory(tmp_path).eos_token_ids == (4, 2)


def test_eos_list_from_gguf_end_of_turn_ids():
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "<|end_of_text|>", "<|eot_id|>"],
        "tokenizer.ggml.token_type": [1, 1, 3, 3],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.eot_token_id": 3,
    }
    assert Tokenizer.from_gguf_metadata(fields).eos_token_ids == (2, 3)
