"""`llmopt plan`: its argument parser (`parser`), flags -> planner inputs (`inputs`), the
handlers that call the planner (`run`) and how plans are shown (`render`).
`llmopt.cli` finds `register` here."""

from llmopt.plan.cli.parser import check_args, register

__all__ = ["check_args", "register"]
