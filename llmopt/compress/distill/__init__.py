"""Distillation: a KD objective for the trainer, students cut from the teacher, distilled drafts.

from llmopt.compress.distill import DistillObjective, kd_loss_sum, make_student
"""

from llmopt.compress.distill.objective import (
    DistillConfigError,
    DistillObjective,
    kd_loss_sum,
    kd_terms,
)
from llmopt.compress.distill.student import make_student

__all__ = ["DistillConfigError", "DistillObjective", "kd_loss_sum", "kd_terms", "make_student"]
