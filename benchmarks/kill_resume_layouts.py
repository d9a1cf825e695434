"""Kill and resume for the optimizer layouts no config in ds_configs/ has: ZeRO 1 in fp32
on one rank, the BF16 optimizer over ZeRO 0, bf16 under ZeRO 1 without fp32 gradient
accumulation, and torch's AdamW instead of FusedAdam, each on tiny_1rank.json. The same
check as the suite's matrix (tests/kill_resume.py ``check_case``: both engines, one rank
SIGKILLed at random points of the save path, 6 kills per engine, every restart from the
newest complete checkpoint, the finished run bitwise the uninterrupted one), with the
same draws as when these cases were in the suite.

    python benchmarks/kill_resume_layouts.py --json benchmarks/results/kill_resume_layouts.json

About 2.5 minutes on 2 cores. Exits non-zero if a case fails (its error is in the table
and the JSON). ``--cases`` takes layout names (tiny_1rank+bf16-zero0) or shipped
configs' (tiny_cpu) to run one case of the suite's matrix alone.
"""

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, write_figures


def main():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")       # before DeepSpeed is imported, here or in the ranks
    from tests.kill_resume import check_case, layout_cases, shipped_cases
    known = {**layout_cases(), **shipped_cases()}
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(layout_cases()), choices=sorted(known), metavar="CASE")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    rows = []
    for i, case in enumerate(args.cases, 1):
        name, change = known[case]
        print(f"[{i}/{len(args.cases)}] {case} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="seekspeed-killresume-") as tmp:
            try:
                report, counts = check_case(Path(tmp), case, name, change)
                row = {"case": case, "config": name, "change": change, "ok": True, "error": None,
                       "kills": {e: k for e, (k, _) in counts.items()},
                       "chains": {e: c for e, (_, c) in counts.items()}, "report": report}
            except AssertionError as e:
                row = {"case": case, "config": name, "change": change, "ok": False,
                       "error": (str(e) or traceback.format_exc()).splitlines()[0][:300], "kills": {}, "chains": {},
                       "report": []}
        row["seconds"] = round(time.monotonic() - t0, 1)
        rows.append(row)
    print(machine_line())
    print(f"\n{'case':<26} {'kills ds / async':>17} {'chains':>7} {'bitwise':>8} {'seconds':>8}")
    for r in rows:
        kills = " / ".join(str(r["kills"].get(e, "-")) for e in ("deepspeed", "async-zstd"))
        print(f"{r['case']:<26} {kills:>17} {sum(r['chains'].values()):>7} {'yes' if r['ok'] else 'NO':>8} "
              f"{r['seconds']:>8.1f}")
        if not r["ok"]:
            print(f"  {r['error']}")
    write_figures(args.json, {"rows": rows})
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
