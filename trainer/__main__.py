"""`python -m trainer ...`: see trainer/cli.py and trainer/README.md."""

import os

# No hub access, ever: models are local paths. Set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from trainer.cli import main  # noqa: E402

raise SystemExit(main())
