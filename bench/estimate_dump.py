"""Every shipped recipe's estimate as JSON, to compare two versions of the estimator byte for byte.

    python bench/estimate_dump.py OUT.json [--tree DIR]

--tree runs the compiletune of another checkout (a `git worktree` of an older commit) instead of
the installed one: its folder comes first on sys.path. Each recipe is estimated as its header's
GPUs say; `seconds` is the time of the call. Compare two files field by field, `seconds` and
`notes` aside.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tree", help="the root of another checkout to import compiletune from")
    a = ap.parse_args()
    if a.tree:
        sys.path.insert(0, a.tree)
    from compiletune import recipes
    from compiletune.config import load_yaml, resolve
    from compiletune.estimate import estimator

    results = {}
    for recipe in recipes.all_recipes():
        name = recipe.name
        values = load_yaml(name)
        values.pop("model_dir", None)
        flags = {"fsdp": True} if recipe.gpus > 1 else {}
        t = time.perf_counter()
        est = estimator.estimate_memory(resolve(values, flags), recipe.gpus).to_dict()
        est["seconds"] = round(time.perf_counter() - t, 1)
        results[name] = est
        print(f"{name:34s} {est['peak_bytes']:>14d} {est['seconds']:6.1f}s", flush=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
