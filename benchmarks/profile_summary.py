"""Where a profiled run's time goes: a py-spy raw profile summarised per function.

    pip install py-spy
    py-spy record -r 40 --format raw -o prof.txt -- python benchmarks/scale.py --worker inprocess \\
        --query-chunk 0 --clients 10000 --per-round 1000 --rounds 8 --samples 30000
    python benchmarks/profile_summary.py prof.txt --thread KeptThread._loop   # the training thread

A ``.gz`` file is read as gzip. Each line of a raw profile is a stack (frames ``function (file:line)`` joined by ``;``) and its
sample count. Prints, for the stacks that contain ``--thread`` (any text of a frame; all stacks
without it) and leaving out stacks inside an import, each function's share of the samples with
its callees (inclusive) and without them (self).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re


def summarise(path: str, must: str = "", top: int = 40) -> str:
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as fh:
        for line in fh:
            stack, _, count = line.rstrip().rpartition(" ")
            if must not in stack or "_find_and_load" in stack:
                continue
            n = int(count)
            total += n
            frames = [re.sub(r":\d+\)", ")", f) for f in stack.split(";")]
            for f in set(frames):
                inclusive[f] += n
            own[frames[-1]] += n
    out = [f"{total} samples" + (f" in stacks through {must!r}" if must else "")]
    for name, counter in (("inclusive", inclusive), ("self", own)):
        out.append(f"--- {name}")
        out += [f"{100 * n / max(total, 1):5.1f}% {f}" for f, n in counter.most_common(top)]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile")
    p.add_argument("--thread", default="", help="only stacks with a frame containing this text")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    print(summarise(args.profile, args.thread, args.top))


if __name__ == "__main__":
    main()
