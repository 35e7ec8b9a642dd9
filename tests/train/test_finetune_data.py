"""Fine-tuning data: formats, loss masks (prompt tokens carry no loss), padding and packing,
the held-out split, LoRA target resolution and the QLoRA backward."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.data.sft import SFTData, encode_record
from llmopt.data.sft_sources import SFTDataError, read_records
from llmopt.models import ModelConfig, build_model
from llmopt.models.loading import load_tokenizer
from llmopt.models.spec import spec_for
from llmopt.parallel.pipeline.executor import IGNORE_INDEX
from llmopt.train.lora import LoraError, LoraSettings, apply_lora, lora_modules, resolve_targets

TOK = load_tokenizer("smollm2-135m")
CHAT = {
    "messages": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Hi again!"},
    ]
}


def test_chat_loss_falls_on_assistant_turns_only():
    ids, mask = encode_record(CHAT, "messages", TOK)
    full = TOK.apply_chat_template(CHAT["messages"], add_generation_prompt=False)
    assert TOK.decode(ids) == full
    supervised = TOK.decode([i for i, m in zip(ids, mask) if m])
    assert supervised == "Hi there!<|im_end|>\nHi again!<|im_end|>\n"
    unsupervised = TOK.decode([i for i, m in zip(ids, mask) if not m])
    assert "Say hi" in unsupervised and "Again" in unsupervised and "Hi there" not in unsupervised


def test_prompt_completion_and_text_masks():
    ids, mask = encode_record({"prompt": "Capital of France:", "completion": " Paris"}, "auto", TOK)
    assert TOK.decode([i for i, m in zip(ids, mask) if m]) == " Paris<|im_end|>"
    assert not any(mask[: len(TOK.encode("Capital of France:"))])
    ids, mask = encode_record({"text": "In the beginning"}, "auto", TOK)
    assert all(mask) and ids[-1] == TOK.eos_token_id


def _write(tmp_path, records) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_rows_pad_with_ignored_labels_and_split_held_out(tmp_path):
    records = [CHAT] * 7 + [{"prompt": f"Q{i}", "completion": f" A{i}"} for i in range(3)]
    data = SFTData.build(_write(tmp_path, records), TOK, 96, seed=0, eval_fraction=0.2)
    assert (data.stats.train_examples, data.stats.eval_examples) == (8, 2)
    assert data.inputs.shape == (8, 96) and data.eval_inputs.shape == (2, 96)
    ids, mask = encode_record(CHAT, "messages", TOK)
    row = next(i for i in range(8) if data.inputs[i, 0] == ids[0] and data.inputs[i, 5] == ids[5])
    labels = data.targets[row]
    expected = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]
    assert labels[: len(expected)].tolist() == expected
    assert (labels[len(expected) :] == IGNORE_INDEX).all()  # padding carries no loss
    assert data.supervised(0, 4) == int((data.targets[data.global_rows(0, 4)] != -100).sum())


def test_packing_masks_the_document_boundary(tmp_path):
    records = [{"prompt": "Q", "completion": " yes"}, {"text": "In the beginning"}]
    data = SFTData.build(_write(tmp_path, records), TOK, 4, seed=0, packing=True, eval_fraction=0)
    first, _ = encode_record(records[0], "auto", TOK)
    second, _ = encode_record(records[1], "auto", TOK)
    assert (len(first), len(second)) == (3, 4) and data.inputs.shape == (2, 4)  # 7 tokens, 2 rows
    assert data.inputs[0].tolist() == first + second[:1]
    # labels: Q -> " yes" (supervised), " yes" -> EOS, EOS -> next document (ignored), ...
    assert data.targets[0].tolist() == [first[1], first[2], IGNORE_INDEX, second[1]]
    assert data.targets[1, 2:].tolist() == [IGNORE_INDEX] * 2  # the padded tail


def test_long_text_is_cut_into_rows_not_truncated(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("In the beginning God created the heavens and the earth. " * 20)
    data = SFTData.build(str(text), TOK, 16, seed=0, eval_fraction=0)
    ids, _ = encode_record({"text": text.read_text()}, "text", TOK)
    assert data.num_sequences == -(-(len(ids) - 1) // 16)
    # every next-token transition of the file is trained exactly once
    labels = data.targets[data.targets != IGNORE_INDEX]
    assert labels.numel() == len(ids) - 1 and data.stats.truncated == 0
    assert sorted(labels.tolist()) == sorted(ids[1:])


def test_bad_data_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(SFTDataError, match="bad.jsonl:2 is not valid JSON"):
        read_records(str(bad))
    with pytest.raises(SFTDataError, match="fits no format"):
        encode_record({"question": "?"}, "auto", TOK)
    with pytest.raises(SFTDataError, match="no assistant turn"):
        encode_record({"messages": [{"role": "user", "content": "x"}]}, "messages", TOK)
    with pytest.raises(SFTDataError, match="not a file or directory"):
        read_records(str(tmp_path / "missing.jsonl"))


CFG = ModelConfig(
    name="tiny", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, max_seq_len=32,
)  # fmt: skip


def test_lora_targets_resolve_through_the_spec():
    spec = spec_for(build_model(CFG, seed=0))
    assert resolve_targets(spec, "all") == spec.block_linears
    attention = resolve_targets(spec, "attention")
    assert len(attention) == 4 and all(n.startswith(spec.attention + ".") for n in attention)
    short = spec.block_linears[0].rsplit(".", 1)[-1]
    assert resolve_targets(spec, short) == (spec.block_linears[0],)
    with pytest.raises(LoraError, match="matches no linear"):
        resolve_targets(spec, "nonexistent")


def test_lora_starts_at_the_base_and_qlora_backward_recomputes_the_weight():
    tokens = torch.randint(0, 128, (2, 10))
    ref = build_model(CFG, seed=0)
    model = build_model(CFG, seed=0)
    apply_lora(model, LoraSettings(rank=4))
    torch.testing.assert_close(model(tokens), ref(tokens), rtol=0, atol=0)  # B = 0
    q = build_model(CFG, seed=0)
    apply_lora(q, LoraSettings(rank=4), quantize_bits=4)
    for lora in lora_modules(q).values():
        torch.nn.init.normal_(lora.lora_B.weight, std=0.05)
    q(tokens).pow(2).sum().backward()
    # reference: the same model with dense (dequantized) frozen weights, plain autograd
    dense = build_model(CFG, seed=0)
    apply_lora(dense, LoraSettings(rank=4))
    for name, lora in lora_modules(dense).items():
        source = lora_modules(q)[name]
        lora.base.weight = source.base.dequantize(torch.float32)
        lora.lora_A.weight.data.copy_(source.lora_A.weight)
        lora.lora_B.weight.data.copy_(source.lora_B.weight)
    dense(tokens).pow(2).sum().backward()
    got = dict(q.named_parameters())
    for name, p in dense.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-4, atol=1e-6)


def test_hf_datasets_source_reads_a_local_dataset_offline(tmp_path):
    # `datasets` comes with the dev dependencies (lm-eval requires it)
    (tmp_path / "train.jsonl").write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT) + "\n")
    records = read_records(f"hf:{tmp_path}")
    assert records == [CHAT, CHAT]
    with pytest.raises(SFTDataError, match="could not be opened offline"):
        read_records(f"hf:{tmp_path / 'missing'}")


def test_finetune_config_errors_are_one_line(monkeypatch):
    from llmopt.train import finetune_config
    from llmopt.train.config import TrainConfig, TrainConfigError

    cases = [
        (dict(lora_rank=8, tp=2), "LoRA with tp=2 is not supported"),
        (dict(qlora=True), "qlora=True needs adapters"),
        (dict(format="messages"), "applies to --data"),
        (dict(save_format="everything"), "save_format='everything' is not valid"),
        (dict(eval_fraction=1.5), "eval_fraction=1.5 must be in"),
        (dict(data="x.jsonl", pp=2), "held-out loss needs pp=1"),
        (dict(report_to="tensorboard,neptune"), "report_to target 'neptune' is not valid"),
    ]
    for changes, message in cases:
        with pytest.raises(TrainConfigError, match=message):
            TrainConfig().replace(**changes)
    real = finetune_config.importlib.util.find_spec
    monkeypatch.setattr(
        finetune_config.importlib.util,
        "find_spec",
        lambda name: None if name == "wandb" else real(name),
    )
    with pytest.raises(TrainConfigError, match="needs the 'wandb' package, which is not installed"):
        TrainConfig(report_to="wandb")
