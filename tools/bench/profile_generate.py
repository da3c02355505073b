"""Host-side profile of `graphrunner generate` (cProfile), for finding per-step CPU overhead.

    python -m graphrunner_tools.bench.profile_generate [generate args...]
Prints the 40 most expensive functions by cumulative and by own time.
"""

import cProfile
import io
import pstats
import sys

from graphrunner.cli import main


def run(argv: list[str]) -> None:
    prof = cProfile.Profile()
    prof.enable()
    main(["generate", *argv])
    prof.disable()
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(40)
        print(buf.getvalue())


if __name__ == "__main__":
    run(sys.argv[1:])
