"""Fine-tuning end to end (one process, a tiny HF-layout model with SmolLM2's tokenizer, chat
data from web-bible sentences): LoRA adapters that `peft` loads onto transformers' model with
the logits of our merged model, a complete hf/ export (AutoTokenizer, AutoModelForCausalLM,
`llmopt generate`), TensorBoard events, `llmopt merge`, QLoRA, save formats, and the
vocabulary checks."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.cli import main
from llmopt.models.loading import load_model
from llmopt.train.config import TrainConfig
from llmopt.train.trainer import train
from tests.finetune_fixtures import chat_jsonl, small_tokenizer, tiny_hf_model

RUN = dict(
    seq_len=64,
    global_batch=4,
    micro_batch=2,
    steps=3,
    lr=2e-2,
    warmup_steps=0,
    progress=False,
    peak_tflops=1.0,
    precision="fp32",
    eval_fraction=0.25,
)
IDS = torch.tensor([[1, 510, 2118, 314, 260, 3469, 28, 9]])


def _lora(root, base, out: str, **changes) -> TrainConfig:
    """The fixture's LoRA run (r=4, alpha 8 on the chat data) into `root / out`."""
    return TrainConfig().replace(
        init_from=str(base),
        data=str(root / "chat.jsonl"),
        format="messages",
        lora_rank=4,
        lora_alpha=8.0,
        out_dir=str(root / out),
        **{**RUN, **changes},
    )


def _merge(run, out) -> int:
    """`llmopt merge` of the fixture's adapter onto its base into `out`."""
    adapter = run["ckpt"] / "adapter"
    return main(["merge", "--base", str(run["base"]), "--adapter", str(adapter), "--out", str(out)])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    base = tiny_hf_model(root / "base")
    chat_jsonl(root / "chat.jsonl")
    result = train(_lora(root, base, "out", report_to="tensorboard", save_format="both"))
    return {
        "root": root,
        "base": base,
        "result": result,
        "ckpt": root / "out/checkpoints/step_000003",
    }


def test_lora_run_logs_eval_loss_and_trains_only_adapters(run):
    result = run["result"]
    assert sorted(result.eval_losses) == [0, 3]
    assert all(torch.isfinite(torch.tensor(v)) for v in result.eval_losses.values())
    log = [json.loads(line) for line in (run["root"] / "out/train_log.jsonl").open()]
    header = log[0]
    # per layer, r=4 (A: r x in, B: out x r): q, o 256; k, v 192 (GQA); gate, up, down 384
    assert header["trainable_parameters"] == 2 * (2 * 256 + 2 * 192 + 3 * 384)
    assert header["data"]["eval_examples"] == 4 and header["data"]["train_examples"] == 12
    steps = [r for r in log if r["event"] == "step"]
    assert len(steps) == 3 and all(0 < r["supervised_tokens"] < 4 * 64 for r in steps)


def test_adapter_loads_in_peft_and_matches_the_merged_model(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(run["base"], dtype=torch.float32)
    with torch.no_grad():
        plain = base(IDS).logits
        peft_model = PeftModel.from_pretrained(base, run["ckpt"] / "adapter")
        theirs = peft_model(IDS).logits
        ours = load_model(run["ckpt"] / "hf")(IDS)
    assert (theirs - plain).abs().max() > 1e-2  # the adapters changed the model
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    config = json.loads((run["ckpt"] / "adapter/adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and len(config["target_modules"]) == 7


def test_hf_checkpoint_is_complete_and_loads_everywhere(run, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = run["ckpt"] / "hf"
    assert not (run["ckpt"] / "full").exists()  # save_format=both: shards + hf/ only
    assert (run["ckpt"] / "rank00000.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    from llmopt.models.loading import load_tokenizer

    text = "In the beginning <|im_start|>user"
    assert tokenizer(text).input_ids == load_tokenizer("smollm2-135m").encode(text)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert model.generation_config.eos_token_id == 2
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, load_model(hf)(IDS), rtol=0, atol=1e-4)
    code = main(
        [
            "generate",
            "--model",
            str(hf),
            "--prompt",
            "In the",
            "--max-new-tokens",
            "3",
            "--json",
            "--eager",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    prompt = torch.tensor([tokenizer("In the").input_ids])
    greedy = model.generate(prompt, max_new_tokens=3, do_sample=False)[0, prompt.shape[1] :]
    assert out["new_tokens"] == 3 and out["token_ids"][-3:] == greedy.tolist()


def test_tensorboard_events_are_readable(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["root"] / "out/tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "eval_loss"}
    assert {f"train/{t}" for t in expected} <= tags
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert losses == pytest.approx(run["result"].losses, rel=1e-6)
    evals = {e.step: e.value for e in acc.Scalars("train/eval_loss")}
    assert evals == pytest.approx(run["result"].eval_losses, rel=1e-6)


def test_merge_folds_the_adapter_into_the_base(run, capsys):
    out = run["root"] / "merged"
    assert _merge(run, out) == 0
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(IDS), load_model(run["ckpt"] / "hf")(IDS))
    assert _merge(run, out) == 0  # an earlier merge output is replaced
    (out / "notes.txt").write_text("mine")  # ... but never a file of the user's
    assert _merge(run, out) == 0 and (out / "notes.txt").read_text() == "mine"
    other = run["root"] / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    capsys.readouterr()
    code = _merge(run, other)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--overwrite" in err and "thesis.tex" in err


def test_qlora_trains_on_an_int4_base_and_hf_only_is_not_resumable(run):
    from llmopt.models.packed.quant.linear import QuantLinear

    cfg = TrainConfig().replace(
        init_from=str(run["base"]),
        data=str(run["root"] / "chat.jsonl"),
        lora_rank=4,
        qlora=True,
        save_format="hf",
        out_dir=str(run["root"] / "qlora"),
        **RUN,
    )
    result = train(cfg)
    assert len(result.losses) == 3 and result.losses[-1] < result.losses[0]
    ckpt = run["root"] / "qlora/checkpoints/step_000003"
    assert sorted(p.name for p in ckpt.iterdir()) == ["adapter", "hf", "manifest.json"]
    from llmopt.train.lora import LoraSettings, apply_lora

    model = load_model(run["base"])
    apply_lora(model, LoraSettings(4), quantize_bits=4)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    with pytest.raises(ValueError, match="save_format=hf and holds no resumable state"):
        train(cfg.replace(resume=True, steps=4))


def test_vocabulary_mismatch_is_a_one_line_error(run, capsys, tmp_path):
    other = tmp_path / "other"
    tiny_hf_model(other, tokenizer=small_tokenizer())
    args = [
        "train",
        "--data",
        str(run["root"] / "chat.jsonl"),
        "--steps",
        "1",
        "--no-progress",
        "--out-dir",
        str(tmp_path / "o"),
    ]
    assert main([*args, "--init-from", str(run["base"]), "--tokenizer", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "vocabulary of 293 tokens" in err and "trained with 49152" in err
    # a tokenizer with ids beyond the model's embedding
    assert main([*args, "--init-from", str(other), "--tokenizer", "smollm2-135m"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "49152" in err and "293" in err


def test_lora_resume_continues_the_trajectory_exactly(run):
    cfg = _lora(run["root"], run["base"], "resumed", save_format="resume")
    first = train(cfg.replace(save_every=2))
    assert first.losses == run["result"].losses  # the same run as the fixture's
    root = run["root"] / "resumed/checkpoints"
    assert sorted(p.name for p in (root / "step_000002").iterdir()) == [
        "manifest.json",
        "rank00000.safetensors",
    ]
    (root / "latest").write_text("step_000002")  # as if the run had stopped after step 2
    second = train(cfg.replace(resume=True))
    assert second.start_step == 2
    assert second.losses == first.losses[2:]  # bit for bit


def test_auto_peft_loads_the_adapter_train_wrote(run, monkeypatch, tmp_path):
    """AutoPeftModelForCausalLM resolves base_model_name_or_path itself (from another working
    directory, offline) and gives the logits of our merged model."""
    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = json.loads((run["ckpt"] / "adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(run["base"].resolve())
    model = AutoPeftModelForCausalLM.from_pretrained(run["ckpt"] / "adapter", dtype=torch.float32)
    with torch.no_grad():
        theirs = model(IDS).logits
        ours = load_model(run["ckpt"] / "hf")(IDS)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_adapter_base_reference(tmp_path, monkeypatch):
    from llmopt.models.registry import resolve
    from llmopt.train.lora import peft_base_reference

    base = tiny_hf_model(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    assert peft_base_reference("base") == str(base.resolve())  # relative -> absolute
    assert peft_base_reference("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert peft_base_reference("smollm2-135m") == str(resolve("smollm2-135m").resolve())
    assert peft_base_reference(None) is None
