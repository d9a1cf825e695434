"""Kill and resume, for every config in ds_configs/: the trainer saves a checkpoint after
every step with DeepSpeed's engine and with async-zstd, one rank SIGKILLs itself at a
random point of the save path, the others are killed as a launcher would, and the same
command runs again with ``--resume auto`` until a run finishes; every restart comes back
from the newest complete checkpoint and the finished run ends bitwise where the
uninterrupted one ends (the machinery and what it compares: tests/kill_resume.py).

Production configs run as their tiny analogues (tests/config_analogues.py). A config
that cannot run here is named in ``kill_resume.CANNOT_RUN`` with the reason; a new file
in ds_configs/ is in the matrix without an edit here. The optimizer layouts no shipped
config has (ZeRO 1 in fp32 on one rank, the BF16 optimizer over ZeRO 0, bf16 under
ZeRO 1 without fp32 accumulation, torch's AdamW) run the same check in
benchmarks/kill_resume_layouts.py. 64 kills per suite run (6 per engine on one rank, 3
on two, 2 on four); about 9 minutes on 2 cores.
"""

import pytest

from tests import config_analogues
from tests.kill_resume import CANNOT_RUN, check_case, planned_kills, shipped_cases

CASES = shipped_cases()


def test_every_config_is_in_the_matrix_or_says_why_not():
    names = set(config_analogues.config_names())
    assert set(CANNOT_RUN) <= names, sorted(set(CANNOT_RUN) - names)
    assert all(why for why in CANNOT_RUN.values())
    assert {name for name, _ in CASES.values()} == names - set(CANNOT_RUN)
    # every config's share of kills: both engines, 2 to 6 each by its world size
    assert all(planned_kills(name) >= 4 for name, _ in CASES.values())


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CASES))
def test_killed_anywhere_in_the_save_path_resumes_bitwise(tmp_path, case):
    name, change = CASES[case]
    report, _ = check_case(tmp_path, case, name, change)
    print("\n".join(report))
