"""``python -m jaxprm.train [--config FILE.yaml] [--resume RUN_DIR] [--print-config] [key.sub=value ...]``.

With no arguments the embedded default runs: the tiny policy is warm-started (cached), the jaxprm
server starts in-process on a free loopback port, and flat GRPO (anchor-state advantages) trains on FrozenLake.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxprm.train",
        description="Process-reward RL for multi-turn agents: rollout -> scoring -> GRPO/PPO update.",
    )
    p.add_argument("--config", help="YAML config file (applied over the embedded default)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest checkpoint that restores; overrides are "
                        "recorded in RUN_DIR/config.resumes/ and kept by later resumes (seed and env.* are frozen)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides (YAML values)")
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    args = _parser().parse_args(argv)
    from jaxprm.train.config import ConfigError, dump_yaml, load_config

    try:
        if args.resume:
            run_dir = Path(args.resume)
            cfg_file = run_dir / "config.yaml"
            if not cfg_file.is_file():
                raise ConfigError(f"--resume {run_dir}: no config.yaml there (not a run directory?)")
            if args.config:
                raise ConfigError("--resume takes the config from the run directory; drop --config")
            from jaxprm.train.resume import check_resume, latest_config_file

            # the latest recorded config (earlier resumes' overrides included) + this resume's overrides
            cfg = load_config(latest_config_file(run_dir), [*args.overrides, f"run_dir={run_dir}"])
            check_resume(run_dir, cfg)
        else:
            cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(dump_yaml(cfg))
        return 0
    from jaxprm.train.loop import TrainError, train

    try:
        summary = train(cfg, resume=bool(args.resume))
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        for note in getattr(e, "__notes__", ()):  # cleanup that failed after the error (the run stopped anyway)
            print(f"note: {note}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print("interrupted; resume with --resume " + getattr(e, "run_dir", cfg.run_dir), file=sys.stderr)
        return 130
    print(summary.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
