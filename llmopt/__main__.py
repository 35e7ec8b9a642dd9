import sys

from llmopt.cli import main

sys.exit(main())
