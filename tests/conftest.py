import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("PYTHONPATH", ROOT)
# compiled ops in this environment's build directory (ds_ext/ops.py), for the test process,
# the ranks it forks and the launchers it starts alike
from ds_ext.ops import use_environment_root  # noqa: E402
use_environment_root()


def pytest_sessionstart(session):
    # Data caches live in one temporary directory per test session, inherited by the
    # ranks and launchers the tests spawn: no test reads or writes the user's caches.
    import tempfile
    cache = tempfile.mkdtemp(prefix="seekspeed-test-cache-")
    session.config._seekspeed_cache = cache      # removed when the session ends
    os.environ.setdefault("SEEKSPEED_CACHE", os.path.join(cache, "seekspeed"))
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(cache, "hf-datasets"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The fused top-k and sign kernels (ds_ext/comm/csrc) are built on first use (setup_env.sh
    # builds them); load or build both here, so that no multi-rank test spends its timeout on them.
    from ds_ext.comm import kernels
    kernels.build_all()


def pytest_sessionfinish(session, exitstatus):
    import shutil
    cache = getattr(session.config, "_seekspeed_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
