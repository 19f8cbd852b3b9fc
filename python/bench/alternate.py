"""What the benchmarks here share: two measurements taken in alternating
order round by round (ABBA, so drift hits both alike), their medians, and
the report line plus optional JSON."""

import json
import statistics


def alternating_medians(first, second, rounds):
    """Medians of `rounds` calls of each zero-argument function, the order
    alternating every round, after one warm-up call of each."""
    first()
    second()
    a, b = [], []
    for r in range(rounds):
        order = ((first, a), (second, b)) if r % 2 == 0 else ((second, b), (first, a))
        for fn, out in order:
            out.append(fn())
    return statistics.median(a), statistics.median(b)


def report(result, line, json_path):
    """Prints `line`; writes `result` as JSON to json_path when given."""
    print(line)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
