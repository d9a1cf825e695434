"""DeepSpeed hostfiles read as DeepSpeed's launcher reads them.

The resource pool comes from DeepSpeed's own parser (``deepspeed.launcher.runner``
``_parse_hostfile``) and the active resources from its own filters
(``parse_inclusion_exclusion`` for ``--include``/``--exclude``,
``apply_num_nodes_and_gpus`` for ``--num_nodes``/``--num_gpus``). A line-by-line pass
with DeepSpeed's rules runs first, only so that an error names the file and the line:
DeepSpeed's launcher reports neither.

A running rank learns what the launcher chose from the ``--world_info`` argument of
its parent, DeepSpeed's per-node launcher (``python -m deepspeed.launcher.launch
--world_info=<base64 JSON>``): the environment it passes on (``WORLD_SIZE``,
``LOCAL_SIZE``, ``CROSS_SIZE``, ``CROSS_RANK``) holds the counts only.
"""

import base64
import binascii
import json
import os
import re

from ds_ext.errors import ConfigError

# DeepSpeed's pattern (runner._parse_hostfile), searched from the start of the stripped
# line; whatever follows the digits is ignored, as the launcher ignores it.
DEEPSPEED_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")

CLI_NAMES = {"include": "--include", "exclude": "--exclude", "num_nodes": "--num_nodes", "num_gpus": "--num_gpus"}


def _line_error(line):
    """Why DeepSpeed's launcher refuses ``line`` (stripped, not a comment)."""
    fields = line.split(None, 1)
    if len(fields) == 1:
        return "expected 'host slots=N' (no slots= after the host name)"
    rest = fields[1]
    if re.match(r"slots\s+=|slots=\s", rest):
        return "write slots=N with no spaces around '=' (DeepSpeed's launcher reads only 'slots=N')"
    if rest.startswith("slots="):
        value = rest[len("slots="):].split()[0] if rest[len("slots="):].split() else ""
        return "slots must be >= 0" if re.fullmatch(r"-\d+", value) else "slots must be an integer"
    return "expected 'host slots=N'"


def parse_hostfile(text, *, path="hostfile"):
    """host -> slots, in file order, exactly as DeepSpeed's launcher parses ``text``.
    Raises ConfigError naming ``path`` and the line for what the launcher refuses."""
    from deepspeed.launcher import runner
    lines = text.splitlines(keepends=True)
    first_seen = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = DEEPSPEED_LINE.search(line)
        if not match:
            raise ConfigError(f"{path}:{number}: {line!r}: {_line_error(line)}")
        host = match.group(1)
        if host in first_seen:
            raise ConfigError(f"{path}:{number}: {line!r}: host {host} is already listed on line {first_seen[host]}; "
                              f"DeepSpeed's launcher refuses a host listed twice: keep one line per host")
        first_seen[host] = number
    if not first_seen:
        raise ConfigError(f"{path}: no hosts (every line is blank or a # comment): list one 'host slots=N' per node")
    try:
        return runner._parse_hostfile(lines)
    except ValueError as exc:              # the pass above follows the same rules; kept for a newer DeepSpeed
        raise ConfigError(f"{path}: {exc}") from None


def read_hostfile(path, *, what="hostfile"):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    return parse_hostfile(text, path=path)


def active_resources(pool, *, include="", exclude="", num_nodes=None, num_gpus=None, path="hostfile",
                     names=CLI_NAMES):
    """host -> slot ids the launcher starts ranks on, by DeepSpeed's rules, from ``pool``
    (host -> slots). ``None`` for num_nodes/num_gpus means not given (DeepSpeed's -1).
    ``names`` says how the four settings are spelled in error messages."""
    from deepspeed.launcher import runner
    include, exclude = include or "", exclude or ""
    if include and exclude:
        raise ConfigError(f"{names['include']} and {names['exclude']} are mutually exclusive (as in DeepSpeed's "
                          f"launcher): keep one")
    counts = [names[k] for k, v in (("num_nodes", num_nodes), ("num_gpus", num_gpus)) if v is not None]
    if counts and (include or exclude):
        raise ConfigError(f"{' and '.join(counts)} cannot be combined with "
                          f"{names['include'] if include else names['exclude']} (DeepSpeed's launcher refuses it): "
                          f"keep one")
    flag, value = (names["include"], include) if include else (names["exclude"], exclude)
    try:
        active = runner.parse_inclusion_exclusion(pool, include, exclude)
    except ValueError as exc:
        raise ConfigError(f"{flag} {value!r} with {path}: {exc}") from None
    active = runner.apply_num_nodes_and_gpus(active, -1 if num_nodes is None else num_nodes,
                                             -1 if num_gpus is None else num_gpus)
    active = {host: list(slots) for host, slots in active.items() if slots}
    if not active:
        given = ", ".join(f"{names[k]} {v!r}" for k, v in (("include", include), ("exclude", exclude),
                                                            ("num_nodes", num_nodes), ("num_gpus", num_gpus))
                          if v not in ("", None))
        raise ConfigError(f"{given} leaves no slots of {path} to run on")
    return active


def launcher_world_info(argv=None):
    """host -> slot ids from the ``--world_info`` argument of DeepSpeed's per-node launcher
    in ``argv`` (default: the parent process's command line, read from /proc); None when
    the parent is not ``deepspeed.launcher.launch`` (torchrun, mpirun, a test harness)."""
    if argv is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            return None
    if "deepspeed.launcher.launch" not in argv and not any(a.endswith(os.path.join("launcher", "launch.py"))
                                                           for a in argv):
        return None
    encoded = None
    for i, arg in enumerate(argv):
        if arg.startswith("--world_info="):
            encoded = arg.split("=", 1)[1]
        elif arg == "--world_info" and i + 1 < len(argv):
            encoded = argv[i + 1]
    if encoded is None:
        return None
    try:
        info = json.loads(base64.urlsafe_b64decode(encoded))
    except (binascii.Error, ValueError) as exc:
        raise ConfigError(f"DeepSpeed's launcher passed a --world_info this version cannot read ({exc})") from None
    return {host: [int(s) for s in slots] for host, slots in info.items()}


def describe(active):
    """'2 hosts (a: 8, b: 4) = 12 slots'."""
    total = sum(len(s) for s in active.values())
    hosts = ", ".join(f"{h}: {len(s)}" for h, s in list(active.items())[:4]) + (", ..." if len(active) > 4 else "")
    return f"{len(active)} host{'s' if len(active) != 1 else ''} ({hosts}) = {total} slots"
