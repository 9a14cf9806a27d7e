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
        description=description, epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(default_config), help="YAML config file")
    parser.add_argument(
        "overrides", nargs="*", help="section.key=value overrides, e.g. train.steps=10 (see below)"
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        configure_logging(config.output.verbose)
        result = fit(config)
    except YattError as exc:
        print(f"error: {exc}", flush=True)
        raise SystemExit(2) from None
    print(f"final checkpoint (Hugging Face format): {result.checkpoint_path}", flush=True)
    return result


def keys_help() -> str:
    """The `--help` epilog: where every config key is described, and the sections."""
    from yatt_ray.config_reference import DOC_PATH, section_summaries

    summaries = section_summaries()
    width = max(len(name) for name, _ in summaries) + 2
    return "\n".join(
        [
            f"config keys: every key with its type, default and meaning is in {DOC_PATH}",
            "(also printed by `python -m yatt_ray.config --reference`). Any key can be overridden as",
            "section.key=value, the value read as YAML (null, true, [a, b]). The sections:",
            *(f"  {name:<{width}}{summary}" for name, summary in summaries),
        ]
    )


def configure_logging(verbose: bool) -> None:
    """The command line's log lines: the library's own INFO lines (the demo build, the data checks) and every
    library's warnings; with `output.verbose=true` every library's INFO lines too."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    logging.getLogger("yatt_ray").setLevel(logging.INFO)
