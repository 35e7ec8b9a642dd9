"""`torchrun --nproc-per-node N -m llmopt.train [--config run.toml] [--flags]`."""

import sys

from llmopt.train.cli import main_worker

sys.exit(main_worker())
