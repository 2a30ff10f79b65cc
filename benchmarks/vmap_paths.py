"""Which training path each shipped scenario takes under ``simulation.vectorize = "auto"``, and why.

    python benchmarks/vmap_paths.py          # one line per simulations/*.toml

Resolves each scenario's environment (no training) and prints what its run's status.json
``training_path`` would say (:func:`fedelastic.train.vectorized.choose_path`). A comparison file
(``[compare]``) is resolved through its first strategy's scenario.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tomllib  # noqa: E402

from fedelastic.comparisons.comparison import expand  # noqa: E402
from fedelastic.environment import RunEnvironment  # noqa: E402
from fedelastic.errors import ConfigError  # noqa: E402
from fedelastic.scenario import load_scenario  # noqa: E402
from fedelastic.train.vectorized import choose_path  # noqa: E402


def main() -> None:
    print("| scenario | strategy | model | MACs a sample | path and why (status.json training_path) |")
    print("|---|---|---|---:|---|")
    for path in sorted((ROOT / "simulations").glob("*.toml")):
        try:
            scenarios = [("", load_scenario(path))]
        except ConfigError:  # a comparison: each strategy's scenario (first fleet and seed)
            seen: dict[str, object] = {}
            for v in expand(tomllib.loads(path.read_text()), str(path))[1]:
                seen.setdefault(v.strategy, v.scenario)
            scenarios = [(f" ({label})", sc) for label, sc in seen.items()]
        for label, scenario in scenarios:
            env = RunEnvironment(scenario)  # type: ignore[arg-type]
            t = scenario.train  # type: ignore[attr-defined]
            macs = env.info.hooked_macs
            print(f"| {path.name}{label} | {t.strategy} | {scenario.model.name} | {macs:,} | {choose_path(env)[1]} |")  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
