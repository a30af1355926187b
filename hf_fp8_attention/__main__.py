"""``python -m hf_fp8_attention`` -> the command-line entry (see cli.py)."""
import sys

from .cli import main

sys.exit(main())
