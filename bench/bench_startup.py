"""Start-up cost: `import transformers_k3` and `python -m transformers_k3 --help`, this tree against a base commit.

Each row runs a fresh interpreter; the two trees alternate round by round (this machine's speed drifts), and the
table gives medians and the per-round ratio's median. With `--importtime` it also prints the modules
`python -X importtime -c "import transformers_k3"` spends the most cumulative time in, for this tree.

    python bench/bench_startup.py --base 7241260 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "import transformers_k3": ["-c", "import transformers_k3"],
    "import + AutoConfig of the small model": ["-c", "import transformers_k3; from transformers import AutoConfig; "
                                               "from transformers_k3.small import SMALL_DIR; "
                                               "AutoConfig.from_pretrained(SMALL_DIR)"],
    "python -m transformers_k3 --help": ["-m", "transformers_k3", "--help"],
}


def checkout(commit: str, into: Path) -> Path:
    """The `src/` of a commit, unpacked into a temporary directory."""
    archive = into / "base.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_once(src: Path, args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def importtime(src: Path, top: int) -> list[tuple[int, str]]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import transformers_k3"], env=env,
                         capture_output=True, text=True, check=True).stderr
    rows = []
    for line in err.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line[len("import time:"):].split("|")
            if cumulative.strip().isdigit():
                rows.append((int(cumulative), name.rstrip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--importtime", type=int, default=0, help="print this many slowest imports of this tree")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": checkout(args.base, Path(tmp)), "head": ROOT / "src"}
        print(f"| case | base {args.base} median | head median | head / base (median of rounds) |")
        print("|---|---:|---:|---:|")
        for case, argv in CASES.items():
            times = {"base": [], "head": []}
            for _ in range(args.rounds):
                for name, src in trees.items():
                    times[name].append(run_once(src, argv))
            ratio = statistics.median(h / b for h, b in zip(times["head"], times["base"]))
            print(f"| {case} | {statistics.median(times['base']):.2f} s | {statistics.median(times['head']):.2f} s "
                  f"| {ratio:.2f} |")
        if args.importtime:
            print("\nslowest imports of this tree (cumulative):")
            for micros, name in importtime(trees["head"], args.importtime):
                print(f"  {micros / 1e6:6.2f} s  {name.strip()}")


if __name__ == "__main__":
    main()
