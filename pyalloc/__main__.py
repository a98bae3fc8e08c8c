"""Command line: `pyalloc replay TRACE` (more commands arrive with the replay issue)."""
import argparse
import json
import sys


def main(argv=None):
    from pyalloc.replay import replay

    parser = argparse.ArgumentParser(prog="pyalloc", description="PyTorch's CUDA caching allocator, replayable")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="replay a recorded PyTorch memory snapshot on the simulated device")
    p.add_argument("trace")
    p.add_argument("--config", default=None)
    p.add_argument("--placement", choices=("recorded", "fresh"), default="recorded")
    p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = replay(args.trace, config=args.config, placement=args.placement)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        for k, v in result.as_dict().items():
            print(f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
