"""``reflexsim`` command line: run, resume, games, export, report, view, replay.

The only place that reads argv and turns errors into exit codes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

USAGE_ERROR = 2

Handler = Callable[[argparse.Namespace], int]


def _games_generate(args: argparse.Namespace) -> int:
    from envs.alfgen import generate

    paths = generate(args.out, per_type=args.per_type, seed=args.seed, task_types=args.task_types, split=args.split)
    print(f"wrote {len(paths)} games under {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reflexsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    games = sub.add_parser("games", help="make or list games").add_subparsers(dest="games_command", required=True)
    gen = games.add_parser("generate", help="generate new ALFWorld games in the $ALFWORLD_DATA layout")
    gen.add_argument("--out", required=True, help="data root to write into")
    gen.add_argument("--per-type", type=int, default=5, help="games per task type")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--task-types", nargs="+", default=None, help="subset: put clean heat cool examine puttwo")
    gen.add_argument("--split", default="train", help="split folder to write (train, eval_in_distribution, eval_out_of_distribution)")
    gen.set_defaults(handler=_games_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # user-facing errors become one line; bugs keep their traceback
        if _is_user_error(exc):
            print(f"reflexsim: error: {exc}", file=sys.stderr)
            return USAGE_ERROR
        raise


def _is_user_error(exc: BaseException) -> bool:
    from agents.llm.base import MissingDependencyError, SpecError
    from envs.errors import EnvError
    from experiments.errors import ConfigError, RunStoreError

    return isinstance(exc, EnvError | ConfigError | RunStoreError | SpecError | MissingDependencyError)


if __name__ == "__main__":
    raise SystemExit(main())
