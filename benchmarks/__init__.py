"""One script per measured claim; each prints a table and writes its figures with --json."""

import json
import os
import sys


def write_figures(path, figures):
    """Write ``figures`` (plus the command that made them) as JSON to ``path``; None: nothing."""
    if not path:
        return
    figures = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), **figures}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(figures, f, indent=2)
    print(f"figures: {path}")
