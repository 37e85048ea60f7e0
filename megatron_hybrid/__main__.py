"""``python -m megatron_hybrid COMMAND ...``: see ``python -m megatron_hybrid --help``."""

from megatron_hybrid.cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
