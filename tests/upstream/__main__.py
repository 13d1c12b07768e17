"""``python -m tests.upstream``: see run.py."""

from __future__ import annotations

from .run import main

raise SystemExit(main())
