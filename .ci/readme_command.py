"""Print one of the README's two set-up commands (`first` or `tests`): the bash block after `<!-- ci: NAME -->`.

`.ci/run` runs what this prints, so CI runs exactly what the README tells a new user to run."""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def command(name: str) -> str:
    match = re.search(rf"<!-- ci: {re.escape(name)} -->\s*```bash\n(.*?)\n```", README.read_text(), re.S)
    if match is None:
        raise SystemExit(f"error: README.md has no bash block after '<!-- ci: {name} -->'")
    return match.group(1).strip()


if __name__ == "__main__":
    print(command(sys.argv[1]))
