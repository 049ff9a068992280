"""``python -m bpclip_fast.train`` = ``bpclip-train``."""

from .cli import main

main()
