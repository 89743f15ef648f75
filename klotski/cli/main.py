"""`klotski`: parse the flags, run one subcommand (klotski/cli/commands.py). Every user mistake
is one line on stderr (what, where, how to fix) and an exit status, never a traceback."""
from __future__ import annotations

import os
import sys

from klotski.cli.parser import build_parser

EXIT_OK, EXIT_FAILED_LINES, EXIT_USAGE, EXIT_STOPPED, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `timeout`, `kill` and schedulers send), handled exactly as Ctrl-C is:
    the batch in flight is dropped, every record written stays, a rerun resumes."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    # Before CUDA starts: segments that grow in place, so fragmentation cannot push the
    # allocator's footprint past what the budget accounts for (a user's own setting wins).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    import signal
    import threading

    from klotski import errors
    from klotski.cli import commands  # after parsing: `klotski --help` loads no torch
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    from klotski.io import registry
    try:
        with registry.downloads(not getattr(args, "no_download", False)):
            return commands.COMMANDS[args.command](args)
    except Terminated:
        print("klotski: terminated; rerun the same command to resume", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("klotski: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except errors.USER_ERRORS as e:
        print(f"klotski: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except errors.RunStopped as e:
        print(f"klotski: error: {e}", file=sys.stderr)
        return EXIT_STOPPED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
