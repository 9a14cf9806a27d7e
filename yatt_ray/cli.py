"""The command line every example shares: `--config FILE` plus `key.sub=value` overrides, then fit()."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from yatt_ray.config import load_config
from yatt_ray.errors import YattError
from yatt_ray.fit import Result, fit


def main(default_config: str | Path, description: str | None = None, argv: list[str] | None = None) -> Result:
    """Parse the command line, train, print where the final policy is, and return the Result.

    Bad input exits with status 2 and the message (which names the value and the fix), not a traceback.
    """
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(default_config), help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.steps=10")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        result = fit(load_config(args.config, args.overrides))
    except YattError as exc:
        print(f"error: {exc}", flush=True)
        raise SystemExit(2) from None
    print(f"final checkpoint (Hugging Face format): {result.checkpoint_path}", flush=True)
    return result
