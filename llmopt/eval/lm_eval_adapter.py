"""lm-evaluation-harness backend `llmopt`: any model `load_model` reads, scored by our forward.

`lm_eval --model llmopt --model_args pretrained=DIR_OR_NAME[,dtype=...,max_length=...]` once this
module is imported (it registers the class with lm-eval's `register_model`); lm-eval 0.4 has no
plugin discovery, so `python -m llmopt.eval.lm_eval_adapter ...` runs lm-eval's own CLI with the
backend registered. Conventions follow lm-eval's HF backend (`hf`) so scores are comparable:
- a context is encoded with the continuation and split (lm-eval's `_encode_pair`), an empty
  context becomes the BOS (else EOS) token, inputs keep their last `max_length` tokens;
- rolling log-likelihood uses lm-eval's disjoint rolling windows of `max_length`;
- generation is greedy unless `do_sample`, stops at any `until` string or any of the model's
  EOS ids (`generation_config.json`'s list), and the context keeps its last
  `max_length - max_gen_toks` tokens;
- `--apply_chat_template` renders with the model's template as transformers does
  (`continue_final_message` when lm-eval asks for no generation prompt, like `hf`), retrying
  without system messages if the template refuses them.
A `model_args` key this backend does not know is refused, naming the valid ones.
Requests run one at a time: exact, and small models on CPU gain little from padding batches.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from llmopt.dtypes import torch_dtype
from llmopt.infer.generate import generate
from llmopt.infer.sampling import SamplingParams
from llmopt.models.chat_template import ChatTemplateError
from llmopt.models.loading import load_model, load_tokenizer


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1")
    return bool(value)


def _device(requested: str | None) -> torch.device:
    """The device to run on; like lm-eval's `hf`, a CUDA request falls back to CPU without CUDA
    (lm-eval's CLI asks for cuda by default)."""
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        logging.getLogger(__name__).warning(
            "device %s requested but CUDA is unavailable; using cpu", requested
        )
        return torch.device("cpu")
    return device


class _Stop(Exception):  # noqa: N818 (control flow, not an error)
    """Raised from `generate`'s token callback once a stop string has appeared."""


@register_model("llmopt")
class LlmoptLM(TemplateLM):
    """An llmopt model behind lm-eval's request API (loglikelihood, rolling, generate_until)."""

    def __init__(
        self,
        pretrained: str,
        dtype: str = "float32",
        device: str | None = None,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        add_bos_token: bool | str = False,
        batch_size: int | str = 1,
        max_batch_size: int | str | None = None,
        seed: int | str = 1234,
        enable_thinking: bool | str | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            valid = list(inspect.signature(LlmoptLM.__init__).parameters)[1:-1]
            raise ValueError(
                f"unknown model_args for --model llmopt: {', '.join(sorted(unknown))}; "
                f"valid: {', '.join(valid)}"
            )
        device = _device(device)
        self.model = load_model(pretrained, dtype=torch_dtype(str(dtype)), device=device)
        self.tokenizer = load_tokenizer(pretrained)
        limit = self.model.config.max_seq_len
        self._max_length = int(max_length) if max_length is not None else limit
        if not 2 <= self._max_length <= limit:
            raise ValueError(
                f"max_length={self._max_length} must be in [2, {limit}] (the model's max_seq_len)"
            )
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _flag(add_bos_token)
        self.seed = int(seed)
        # accepted for lm-eval's CLI (it always passes them); requests run one by one
        self.batch_size, self.max_batch_size = batch_size, max_batch_size
        self._device = device
        self._pretrained = str(pretrained)
        self.chat_template_args: dict[str, Any] = {}
        if enable_thinking is not None:
            self.chat_template_args["enable_thinking"] = _flag(enable_thinking)

    # ---- tokenisation (lm-eval's TemplateLM hooks) ----
    @property
    def eot_token_id(self) -> int:
        if self.tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token, which lm-eval needs as end of text")
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        add_bos = (
            self.add_bos_token
            if add_special_tokens is None
            else add_special_tokens and self.add_bos_token
        )
        return self.tokenizer.encode(string, add_bos=add_bos)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ---- chat templates (lm-eval's --apply_chat_template) ----
    @property
    def tokenizer_name(self) -> str:
        """Fingerprints lm-eval's request cache, as `hf` does with the model path."""
        return self._pretrained.replace("/", "__")

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        def render(history: list[dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(
                history,
                add_generation_prompt,
                continue_final_message=not add_generation_prompt,
                **self.chat_template_args,
            )

        try:
            return render(chat_history)
        except ChatTemplateError:
            logging.getLogger(__name__).warning(
                "the chat template failed; retrying without the system messages (as lm-eval's hf)"
            )
            return render([m for m in chat_history if m["role"] != "system"])

    # ---- scoring ----
    @torch.inference_mode()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log P(continuation | context) and whether greedy decoding would produce it."""
        whole = (context + continuation)[-(self.max_length + 1) :]
        inputs = torch.tensor([whole[:-1]], device=self._device)
        n = len(continuation)
        logits = self.model(inputs)[0, -n:]
        logprobs = F.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(continuation, device=self._device)
        total = logprobs.gather(1, target[:, None]).sum().item()
        return total, bool((logprobs.argmax(-1) == target).all())

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        out = []
        for cache_key, context, continuation in tqdm(requests, disable=disable_tqdm):
            if not continuation:
                raise ValueError(f"empty continuation for request {cache_key!r}")
            result = self._score(context, continuation)
            out.append(result)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            total = sum(self._score(*make_disjoint_window(w))[0] for w in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out

    # ---- generation ----
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if max_gen >= self.max_length:
                raise ValueError(f"max_gen_toks={max_gen} must be < max_length={self.max_length}")
            sampling = SamplingParams(
                temperature=float(kwargs.get("temperature", 0.0))
                if kwargs.get("do_sample")
                else 0.0,
                top_k=int(kwargs.get("top_k") or 0),
                top_p=float(kwargs.get("top_p") or 1.0),
            )
            ids = self.tok_encode(context)[-(self.max_length - max_gen) :]
            text = self.tok_decode(self._generate(ids, max_gen, until, sampling))
            text = postprocess_generated_text(text, until, None)
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out

    def _generate(
        self, ids: list[int], max_new: int, until: list[str], sampling: SamplingParams
    ) -> list[int]:
        produced: list[int] = []
        stops = [s for s in until if s]
        ends = set(self.tokenizer.eos_token_ids)

        def on_token(token: int) -> None:
            produced.append(token)
            if token in ends:
                raise _Stop
            text = self.tok_decode(produced, skip_special_tokens=False)
            if stops and any(s in text for s in stops):
                raise _Stop

        try:
            generate(
                self.model,
                ids,
                max_new_tokens=max_new,
                sampling=sampling,
                seed=self.seed,
                eos_token_id=self.eot_token_id,
                on_token=on_token,
            )
        except _Stop:
            pass
        return produced


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line, with the `llmopt` backend registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
