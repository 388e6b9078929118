"""``python -m goodput.worker serve ...`` (same as the ``goodput-worker`` console script)."""
from goodput.worker.cli import main

raise SystemExit(main())
