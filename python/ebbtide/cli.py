"""Command line: `ebbtide info`, `ebbtide bench` and `ebbtide colocate` (also `python -m ebbtide ...`); docs/cli.md.

Exit status: 0 success; 1 a failure while running (a suite failed, an output could not be written, the native
library is missing or mismatched, an ebbtide error); 2 a usage error, reported before anything runs (bad
arguments, an unknown suite, an output path that cannot be written, a chart without matplotlib, an unparseable
EBBTIDE_* setting); 130 interrupted. Errors are one line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys

from .errors import EbbtideError, SettingError


def _info(args) -> int:
    from . import info  # noqa: PLC0415

    data = info.collect()
    print(json.dumps(data, indent=2) if args.json else info.render(data))
    # Everything is printed first; then a bad setting makes the status 2 (the user's input, as everywhere in this
    # command), so a script that runs `ebbtide info` before a job stops where the job's first call would refuse.
    if data["settings_problems"]:
        names = ", ".join(p["name"] or "?" for p in data["settings_problems"])
        print(f"ebbtide info: {len(data['settings_problems'])} setting(s) do not parse ({names}): ebbtide refuses "
              "to run with them; fix or unset them (above: what each accepts)", file=sys.stderr)
        return 2
    return 0


def _bench(args) -> int:
    from .bench import runner  # noqa: PLC0415

    return runner.main(args.suites, quick=args.quick, json_path=args.json, plot_path=args.plot,
                       list_only=args.list)


def _colocate(argv: list) -> int:
    from .bench.colocate.launcher import main as colocate_main  # noqa: PLC0415

    return colocate_main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ebbtide", description="ebbtide: GPU memory and communication runtime "
                                "for colocated RL post-training",
                                epilog="exit status: 0 success, 1 failure while running, 2 usage error (nothing "
                                "was run), 130 interrupted. See docs/cli.md.")
    sub = p.add_subparsers(dest="command", required=True)
    pi = sub.add_parser("info", help="what was built and what this machine has")
    pi.add_argument("--json", action="store_true", help="print JSON instead of text")
    pi.set_defaults(fn=_info)
    pb = sub.add_parser("bench", help="run the benchmark suites (all by default)")
    pb.add_argument("suites", nargs="*", metavar="suite", help="suite names, or 'all' (default)")
    pb.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    pb.add_argument("--json", metavar="FILE", help="write every row and the environment as JSON")
    pb.add_argument("--plot", metavar="FILE.png", help="draw a PNG chart (needs matplotlib)")
    pb.add_argument("--list", action="store_true", help="list the suites and exit")
    pb.set_defaults(fn=_bench)
    # every argument after `colocate` is the harness's own (ebbtide.bench.colocate); main() hands them over before
    # this parser sees them, so `ebbtide colocate --help` prints the harness's flags
    sub.add_parser("colocate", add_help=False,
                   help="the colocated RL loop benchmark (trainer + rollout on each GPU, beside the same loop on "
                        "today's tools; --trainer megatron for Megatron-core); `ebbtide colocate --help` for its "
                        "flags")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["colocate"]:
        fn = lambda: _colocate(argv[1:])  # noqa: E731
    else:
        args = build_parser().parse_args(argv)
        fn = lambda: args.fn(args)  # noqa: E731
    try:
        return fn()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SettingError as e:  # an EBBTIDE_* variable that does not parse: the user's input
        print(f"ebbtide: {e}", file=sys.stderr)
        return 2
    except (ImportError, EbbtideError) as e:  # e.g. the native extension is missing or mismatched
        print(f"ebbtide: {e}", file=sys.stderr)
        return 1
