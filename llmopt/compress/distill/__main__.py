"""`torchrun ... -m llmopt.compress.distill --config <out>/distill_config.json [--json]`."""

import argparse
import json
import sys

from llmopt.compress.distill.run import run_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmopt.compress.distill")
    parser.add_argument("--config", required=True, help="distill_config.json written by prepare")
    parser.add_argument("--json", action="store_true", help="print the summary on rank 0")
    args = parser.parse_args(argv)
    try:
        summary = run_rank(args.config)
    except Exception as exc:  # the boundary of `llmopt`: input errors in one line, bugs traced
        from llmopt.cli import fail

        return fail("distill", exc)
    if summary and args.json:
        print(json.dumps(summary))
    return 0


sys.exit(main())
