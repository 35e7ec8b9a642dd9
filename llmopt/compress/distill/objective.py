"""Knowledge distillation as a trainer objective: T²·KL(teacher ‖ student) at temperature T,
mixed with the next-token CE on the labels.

    loss = alpha · T² · KL(softmax(t/T) ‖ softmax(s/T)) + (1 - alpha) · CE(s, labels)

summed over the tokens whose label is not ignored (the executor divides by the batch's token
count). T² keeps the soft-target gradients on the CE scale as T changes (Hinton et al. 2015).

`DistillObjective` plugs into `llmopt.parallel.engine` (`Objective`): `bind(tokens, labels)`
runs once per step on the step's own batch, and the loss it returns computes the teacher's
logits per micro-batch from the input rows of that micro-batch, so no teacher logits are
stored for the whole step. Micro-batch k of a step is the k-th loss call (pp=1 runs the
forwards in micro-batch order); each call checks its labels against the rows it took, so a
misaligned batch fails loudly rather than distilling the wrong text.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.errors import LlmoptError

IGNORE_INDEX = -100


class DistillConfigError(LlmoptError, ValueError):
    """A distillation setting that cannot work; the message names the value and the range."""


def check_kd_settings(temperature: float, alpha: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or (
        temperature <= 0
    ):
        raise DistillConfigError(f"temperature={temperature!r} must be a finite number > 0")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)) or not 0 <= alpha <= 1:
        raise DistillConfigError(f"alpha={alpha!r} must be in [0, 1] (1: KL only, 0: CE only)")


def kd_terms(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(KL sum at temperature T, CE sum, token count) over the tokens with a label, in fp32
    at least (fp64 logits stay fp64).

    KL is KL(softmax(t/T) ‖ softmax(s/T)), not yet scaled by T²."""
    if student_logits.shape != teacher_logits.shape:
        raise DistillConfigError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ: the student needs the teacher's vocabulary"
        )
    vocab = student_logits.shape[-1]
    keep = labels.reshape(-1) != IGNORE_INDEX
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    s = student_logits.reshape(-1, vocab)[keep].to(dtype)
    t = teacher_logits.reshape(-1, vocab)[keep].to(dtype)
    log_q = F.log_softmax(s / temperature, dim=-1)
    log_p = F.log_softmax(t / temperature, dim=-1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="sum")
    ce = F.cross_entropy(s, labels.reshape(-1)[keep], reduction="sum")
    return kl, ce, int(keep.sum())


def kd_loss_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    alpha: float = 0.5,
) -> torch.Tensor:
    """alpha·T²·KL + (1-alpha)·CE, summed over the labelled tokens (see the module doc)."""
    kl, ce, _ = kd_terms(student_logits, teacher_logits, labels, temperature)
    return alpha * temperature**2 * kl + (1 - alpha) * ce


class DistillObjective:
    """The engine `Objective` for distilling `teacher` into the trained model."""

    def __init__(
        self, teacher: nn.Module | None, temperature: float = 1.0, alpha: float = 0.5
    ) -> None:
        check_kd_settings(temperature, alpha)
        if teacher is None and alpha > 0:
            raise DistillConfigError(f"alpha={alpha} > 0 needs a teacher (alpha=0: CE only)")
        self.teacher = teacher.eval().requires_grad_(False) if teacher is not None else None
        self.temperature, self.alpha = float(temperature), float(alpha)
        self._sums = torch.zeros(3, dtype=torch.float64)  # KL(T=1), CE, tokens of this step
        self._device = torch.device("cpu")

    def bind(self, tokens: torch.Tensor, labels: torch.Tensor):
        calls = [0]
        self._sums = torch.zeros(3, dtype=torch.float64)

        def loss(logits: torch.Tensor, mb_labels: torch.Tensor) -> torch.Tensor:
            rows = mb_labels.shape[0]
            k = calls[0]
            calls[0] += 1
            inputs = tokens[k * rows : (k + 1) * rows]
            _check_alignment(inputs, mb_labels, k)
            self._device = logits.device
            if self.alpha == 0:  # CE only (the undistilled baseline): no teacher pass
                ce = F.cross_entropy(
                    logits.flatten(0, -2).float(),
                    mb_labels.flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                n = int((mb_labels != IGNORE_INDEX).sum())
                self._sums += torch.tensor([math.nan, float(ce.detach()), n], dtype=torch.float64)
                return ce
            with torch.no_grad():
                teacher_logits = self.teacher(inputs.to(logits.device))
            kl, ce, n = kd_terms(logits, teacher_logits, mb_labels, self.temperature)
            with torch.no_grad():  # the logged KL is at T=1: comparable across temperatures
                kl1 = kl
                if self.temperature != 1:
                    kl1 = kd_terms(logits.detach(), teacher_logits, mb_labels, 1.0)[0]
                self._sums += torch.tensor([float(kl1), float(ce.detach()), n], dtype=torch.float64)
            return self.alpha * self.temperature**2 * kl + (1 - self.alpha) * ce

        return loss

    def metrics(self, dp_group: Any) -> dict[str, float]:
        """Token means of this step over all DP ranks: teacher-student KL (T=1) and CE."""
        sums = self._sums.to(self._device)  # NCCL reduces only CUDA tensors
        if dp_group is not None and dp_group.size > 1:
            dp_group.all_reduce(sums)
        sums = sums.cpu()
        tokens = max(float(sums[2]), 1.0)
        out = {"kd_ce": float(sums[1]) / tokens}
        if not math.isnan(float(sums[0])):  # alpha=0 measures no KL
            out["kd_kl"] = float(sums[0]) / tokens
        return out


def _check_alignment(inputs: torch.Tensor, labels: torch.Tensor, k: int) -> None:
    """Labels must be the inputs shifted by one (where labelled): the teacher reads inputs."""
    if inputs.shape != labels.shape:
        raise DistillConfigError(
            f"micro-batch {k}: inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} "
            "differ in shape"
        )
    nxt, lab = inputs[:, 1:].to(labels.device), labels[:, :-1]
    known = lab != IGNORE_INDEX
    if not torch.equal(nxt[known], lab[known]):
        raise DistillConfigError(
            f"micro-batch {k}: labels are not the inputs shifted by one token; distillation "
            "reads the teacher's logits from the inputs and needs next-token labels"
        )
