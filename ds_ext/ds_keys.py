"""DeepSpeed's own keys, checked through DeepSpeed's own code before a run starts.

DeepSpeed parses ``zero_optimization``, ``bf16`` and ``fp16`` with pydantic models,
but leniently (``"false"`` reads as False, ``"1"`` as 1) while seekspeed reads the
same JSON as written; and it checks the optimizer and the scheduler only when the
engine builds and first steps them, after process groups and report files exist.
Here, before any of that:

- each pydantic section is parsed by DeepSpeed's model, then by a strict twin of it
  (the same model with pydantic's strict mode): a value DeepSpeed would have to
  coerce from another JSON type (a string for a boolean, a boolean for a stage) is
  an error that says what to write; a number for a number is not (``5e8`` for an
  integer field reads the same everywhere);
- the optimizer and the scheduler are built by the engine's own methods
  (``_configure_basic_optimizer``, ``_scheduler_from_config``, so the class DeepSpeed
  picks for the type on this machine) for a one-element dummy parameter, and stepped
  once; a failure is pinned to one key by building again without it (or with it
  alone). No compiled op is built or loaded for it (a check must not wait on a C++
  build, see ds_ext/ops.py): DeepSpeed's op loader answers with the op's binding as
  declared, whose arguments are converted as pybind11 converts them and whose
  arithmetic is not run (FusedAdam's ``multi_tensor_adam``, ``_KERNEL_BINDINGS``); an
  optimizer whose op has no binding here is checked up to the load of its op. The ops
  the optimizer asked for are what ``check`` returns, for the trainer to load;
- ``data_types.grad_accum_dtype`` is resolved by the engine's ``get_data_types``.

Every failure is one ``ConfigError`` line naming the key path, the value and the fix.
"""

import contextlib
import difflib
import inspect
import json
import logging
import os

from .errors import ConfigError


def check(ds, *, resolved):
    """Check DeepSpeed's keys of ``ds`` (the JSON as a dict); ``resolved`` is the
    ``DeepSpeedConfig`` DeepSpeed's parser made of it. Returns the class names of the
    op builders DeepSpeed's optimizer for it loads (sorted)."""
    requested = set()
    with _quiet_deepspeed(), _ops_as_declared(requested):
        view_cls = _engine_view_class()
        view = view_cls(resolved)
        _check_data_types(ds, view)
        _check_optimizer_and_scheduler(ds, view_cls, resolved)
    return tuple(sorted(requested))


# --- compiled ops, as their bindings declare them ------------------------------------

class _OpNotLoaded(Exception):
    """An op the check does not load: the optimizer is checked up to here."""


def _pybind_float(name, value):
    import numbers
    if not isinstance(value, numbers.Real):       # pybind11 takes int, float, bool and numpy scalars
        raise TypeError(f"incompatible function arguments: {name} {value!r} is not a float")


def _pybind_int(name, value):
    import numbers
    if not isinstance(value, numbers.Integral):   # pybind11 refuses a float for an int
        raise TypeError(f"incompatible function arguments: {name} {value!r} is not an int")


class _FusedAdamBinding:
    """DeepSpeed's fused_adam op as its binding declares it (ops/csrc/cpu/adam/fused_adam.cpp
    and csrc/adam/fused_adam_frontend.cpp: int chunk_size, Tensor noop_flag, a list of
    tensor lists, float lr, beta1, beta2, epsilon, int step, mode, bias_correction, float
    weight_decay)."""

    @staticmethod
    def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
                          bias_correction, weight_decay):
        import torch
        _pybind_int("chunk_size", chunk_size)
        if not isinstance(noop_flag, torch.Tensor) or not all(
                isinstance(t, torch.Tensor) for group in tensor_lists for t in group):
            raise TypeError("incompatible function arguments: tensors expected")
        for name, value in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("epsilon", epsilon),
                            ("weight_decay", weight_decay)):
            _pybind_float(name, value)
        for name, value in (("step", step), ("mode", mode), ("bias_correction", bias_correction)):
            _pybind_int(name, value)


_KERNEL_BINDINGS = {"fused_adam": _FusedAdamBinding}


@contextlib.contextmanager
def _ops_as_declared(requested):
    """DeepSpeed's op loader answering with ``_KERNEL_BINDINGS`` (or ``_OpNotLoaded``),
    recording each builder asked for in ``requested``."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    plain = OpBuilder.load

    def load(builder, verbose=False):
        requested.add(type(builder).__name__)
        if builder.name not in _KERNEL_BINDINGS:
            raise _OpNotLoaded(builder.name)
        return _KERNEL_BINDINGS[builder.name]

    OpBuilder.load = load
    try:
        yield
    finally:
        OpBuilder.load = plain


def check_pydantic_sections(ds):
    """``zero_optimization``, ``bf16`` (or its old name ``bfloat16``) and ``fp16``
    through DeepSpeed's pydantic models, lenient then strict."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    bf16 = "bfloat16" if "bf16" not in ds and "bfloat16" in ds else "bf16"
    for key, model in (("zero_optimization", DeepSpeedZeroConfig), (bf16, DeepSpeedBF16Config),
                       ("fp16", DeepSpeedFP16Config)):
        value = ds.get(key)
        if not isinstance(value, dict):      # absent; a non-object is refused by the caller
            continue
        _check_model(key, model, value)


# --- pydantic sections -------------------------------------------------------------

def _check_model(key, model, value):
    import pydantic
    with _quiet_deepspeed():
        try:
            lenient = model(**value)
        except pydantic.ValidationError as exc:
            raise ConfigError(_lenient_error(key, model, exc.errors()[0])) from None
        try:
            _strict_twin(model)(**value)
        except pydantic.ValidationError as exc:
            for error in exc.errors():
                read = _read_as(lenient, error["loc"])
                if _is_number(error["input"]) and _is_number(read):
                    continue                  # 5e8 for an integer, 1 for a stage enum: the same number
                raise ConfigError(_coerced_error(key, model, error, read)) from None


_STRICT_TWINS = {}


def _strict_twin(model):
    """``model`` with pydantic's strict mode: the same fields and validators, no
    coercion between JSON types. (Nested models keep their own, lenient, mode.)"""
    import pydantic
    if model not in _STRICT_TWINS:
        _STRICT_TWINS[model] = type(f"Strict{model.__name__}", (model,),
                                    {"model_config": pydantic.ConfigDict(**model.model_config, strict=True),
                                     "__module__": __name__})
    return _STRICT_TWINS[model]


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_as(lenient, loc):
    """What DeepSpeed's lenient model read at ``loc`` (None if it cannot be found)."""
    node = lenient
    for part in loc:
        node = getattr(node, part, None) if not isinstance(part, int) else None
        if node is None:
            return None
    return getattr(node, "value", node)


def _json_kind(value):
    if isinstance(value, bool):
        return "a boolean"
    if _is_number(value):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _expected_kind(model, loc):
    import enum
    field = model.model_fields.get(loc[0]) if len(loc) == 1 else None
    tp = field.annotation if field is not None else None
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"one of {[m.value for m in tp]}"
    return None


def _dotted(key, loc):
    return ".".join([key] + [str(p) for p in loc])


def _lenient_error(key, model, error):
    where = _dotted(key, error["loc"])
    if error["type"] == "extra_forbidden":
        name = str(error["loc"][-1])
        known = sorted(set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias})
        close = difflib.get_close_matches(name, known, n=1) if len(error["loc"]) == 1 else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (f"{where} is not a key of DeepSpeed's {key} section{hint}; remove it or fix its name "
                f"(DeepSpeed's {model.__name__})")
    msg = error["msg"][0].lower() + error["msg"][1:] if error["msg"] else "invalid"
    expected = _expected_kind(model, error["loc"])
    if expected is not None:
        return (f"{where} {json.dumps(error.get('input'))} must be {expected} (DeepSpeed's {model.__name__}: "
                f"{msg})")
    return f"{where} {json.dumps(error.get('input'))}: {msg} (DeepSpeed's {model.__name__}); fix the value"


def _coerced_error(key, model, error, read):
    where = _dotted(key, error["loc"])
    expected = _expected_kind(model, error["loc"]) or "another JSON type"
    fix = f": write {json.dumps(read)}" if read is not None else ""
    return (f"{where} {json.dumps(error['input'])} must be {expected}, not {_json_kind(error['input'])} "
            f"(DeepSpeed's {model.__name__} would read it as {json.dumps(read)}, seekspeed as written){fix}")


# --- the engine's own builders on a dummy parameter ---------------------------------

# DeepSpeedEngine methods that read only the parsed config, borrowed as they are.
_BORROWED = ("_configure_basic_optimizer", "get_optimizer_configuration", "_scheduler_from_config",
             "_muon_param_groups", "_muon_half_defaults", "get_data_types", "fp16_enabled", "bfloat16_enabled",
             "zero_use_cpu_optimizer", "bf16_optimizer_states")


class _EngineViewBase:
    """What those methods read from an engine: the parsed config, no module, no
    process group, no client optimizer or scheduler."""
    client_optimizer = None
    client_lr_scheduler = None
    has_moe_layers = False
    global_rank = 0

    def __init__(self, config, *, optimizer=None, scheduler=None):
        self._config = config
        self.zenflow = config.zero_config.zenflow is not None
        self._optimizer = (config.optimizer_name, config.optimizer_params) if optimizer is None else optimizer
        self._scheduler = (config.scheduler_name, config.scheduler_params) if scheduler is None else scheduler

    # the engine's getters, with the section swapped for the one being tried
    def optimizer_name(self):
        return self._optimizer[0]

    def optimizer_params(self):
        return self._optimizer[1]

    def scheduler_name(self):
        return self._scheduler[0]

    def scheduler_params(self):
        return self._scheduler[1]


def _engine_view_class():
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return type("_EngineView", (_EngineViewBase,),
                {name: inspect.getattr_static(PipelineEngine, name) for name in _BORROWED})


@contextlib.contextmanager
def _quiet_deepspeed():
    """DeepSpeed's warnings while trying builds (a scheduler asked for its rate before
    its first step, ...) come again when the engine builds them for real."""
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _dummy_device():
    """Where the engine would hold the parameter: this rank's accelerator device."""
    import torch
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return torch.device("cpu")
    return torch.device(acc.device_name(int(os.environ.get("LOCAL_RANK", "0"))))


def _check_data_types(ds, view):
    value = ds.get("data_types", {}).get("grad_accum_dtype")
    try:
        view.get_data_types()
    except (ValueError, KeyError) as exc:
        from deepspeed.runtime.config import DtypeEnum
        names = [str(v) for m in DtypeEnum for v in m._all_values[2:]]
        raise ConfigError(f"data_types.grad_accum_dtype {value!r} is not a dtype DeepSpeed knows ({_first_line(exc)}); "
                          f"use one of {names} (\"fp32\": accumulate bf16/fp16 gradients in fp32), or remove it") \
            from None


def _first_line(exc, limit=200):
    text = (str(exc).strip().splitlines() or [""])[0].rstrip(":")
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _section(ds, key, allowed):
    section = ds.get(key)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"{key!r} must be an object, got {section!r}")
    for name in section:
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}.{name} is not a DeepSpeed {key} key{hint}; allowed: {list(allowed)}")
    if "type" not in section:
        raise ConfigError(f"{key}.type is missing: name the {key} DeepSpeed should build")
    if not isinstance(section["type"], str):
        raise ConfigError(f"{key}.type must be a string, got {section['type']!r}")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"{key}.params must be an object, got {params!r}")
    return section


class _Trial:
    """Builds the optimizer (and scheduler) as DeepSpeed's engine would, for one dummy
    parameter, and steps them once. Returns the exception, or None."""

    def __init__(self, view_cls, config):
        self.view_cls, self.config = view_cls, config
        self.device = _dummy_device()
        self.built = None                    # (optimizer, None) of the last trial that built one

    def __call__(self, optimizer, scheduler=None):
        import torch
        import warnings
        view = self.view_cls(self.config, optimizer=optimizer, scheduler=scheduler or (None, None))
        try:
            # eager: the step checks the values, and an optimizer whose update is
            # torch.compile'd (DeepSpeed's Muon) would otherwise compile it for a 2x2
            # matrix on every rank of every launch
            with warnings.catch_warnings(), torch.compiler.set_stance("force_eager"):
                warnings.simplefilter("ignore")
                params = [torch.nn.Parameter(torch.zeros(1, device=self.device))]
                if str(optimizer[0]).lower() == "muon":
                    # Muon takes parameters deepspeed.set_optimizer_flags has tagged: one
                    # matrix for its Newton-Schulz half, one vector for its auxiliary Adam
                    params.append(torch.nn.Parameter(torch.zeros(2, 2, device=self.device)))
                    for p in params:
                        p.use_muon = p.dim() >= 2
                opt = view._configure_basic_optimizer(params)
                self.built = (opt, None)
                for p in params:
                    p.grad = torch.zeros_like(p)
                opt.step()
                if scheduler is not None:      # as the engine does: build, then optimizer step, scheduler step
                    sched = view._scheduler_from_config(opt)
                    opt.step()
                    sched.step()
            return None
        except _OpNotLoaded:
            return None                      # checked as far as can be without building the op
        except AttributeError as exc:
            if isinstance(getattr(exc, "obj", None), _EngineViewBase):
                raise                        # DeepSpeed asked its engine for more than the view holds
            return exc
        except Exception as exc:  # whatever the optimizer or scheduler raises for a value it cannot take
            return exc


def _signature(cls, *, skip):
    """(parameters, accepts **kwargs) of ``cls.__init__`` without its first ``skip`` arguments."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1 + skip:]
    except (TypeError, ValueError):
        return {}, True
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    return {p.name: p for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}, var_kw


def _blame(trial_of, params, signature):
    """The key of ``params`` that makes ``trial_of`` fail: the first whose removal
    makes it pass; else, with the required keys alone, the one of them when they fail
    (a required key cannot be removed), or the first other key that fails beside them."""
    for key in params:
        if trial_of({k: v for k, v in params.items() if k != key}) is None:
            return key
    names = [k for k, p in signature.items() if p.default is p.empty]
    if any(k not in params for k in names):
        return None                          # a required key is missing: no trial can pass
    required = {k: params[k] for k in names}
    if trial_of(required) is not None:
        return names[0] if len(names) == 1 else None
    for key in params:
        if key not in required and trial_of(required | {key: params[key]}) is not None:
            return key
    return None


def _expected_value(param):
    if param is None:
        return "a valid value"
    tp, default = param.annotation, param.default
    if isinstance(tp, str):                  # postponed annotations (torch's schedulers)
        tp = {"int": int, "float": float, "bool": bool, "str": str}.get(tp, tp)
    if tp is bool or isinstance(default, bool):
        return "true or false" + (f" (default {json.dumps(default)})" if isinstance(default, bool) else "")
    if tp in (int, float) or _is_number(default):
        kind = "an integer" if tp is int or (tp is param.empty and isinstance(default, int)) else "a number"
        return kind + (f" such as its default {default!r}" if _is_number(default) else "")
    if isinstance(default, (tuple, list)):
        return f"a list such as its default {json.dumps(list(default))}"
    if tp is str or isinstance(default, str):
        return "a string" + (f" such as its default {default!r}" if isinstance(default, str) else "")
    return f"a value such as its default {default!r}" if default is not param.empty else "a valid value"


def _param_error(section, params, key, exc, cls, signature, var_kw, built_for):
    where = f"{section}.params.{key}"
    if key not in signature and not var_kw:
        close = difflib.get_close_matches(key, list(signature), n=1) if isinstance(exc, TypeError) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (f"{where} is not a parameter of {cls.__name__}, {built_for}{hint} ({_first_line(exc)}); "
                f"remove it or use one of {list(signature)}")
    return (f"{where} {json.dumps(params[key])}: {cls.__name__}, {built_for}, fails with it ({_first_line(exc)}); "
            f"give {_expected_value(signature.get(key))}")


def _type_error(kind, name, exc):
    """``kind``.type names no class DeepSpeed can build: suggest DeepSpeed's own names and torch's."""
    import torch
    if kind == "optimizer":
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS as own
        module, base = torch.optim, torch.optim.Optimizer
    else:
        from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES as own
        module, base = torch.optim.lr_scheduler, torch.optim.lr_scheduler.LRScheduler
    torch_names = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, base)
                         and v is not base and not n.startswith("_"))
    lower = {n.lower(): n for n in torch_names + list(own)}
    close = difflib.get_close_matches(name.lower(), list(lower), n=1)
    hint = f" (did you mean {lower[close[0]]!r}?)" if close else ""
    return (f"{kind}.type {name!r} is not {'an' if kind == 'optimizer' else 'a'} {kind} DeepSpeed can build ({_first_line(exc)}){hint}; use one of "
            f"DeepSpeed's {list(own)} or a class name of {module.__name__}")


def _scheduler_class(name):
    """The class ``_scheduler_from_config`` looks up for ``name`` (None: none)."""
    import torch
    from deepspeed.runtime import lr_schedules
    if hasattr(lr_schedules, name):
        return getattr(lr_schedules, name)
    return getattr(torch.optim.lr_scheduler, name, None)


def _check_optimizer_and_scheduler(ds, view_cls, config):
    from deepspeed.runtime.constants import LEGACY_FUSION, OPTIMIZER_PARAMS, SCHEDULER_PARAMS, TYPE
    optimizer = _section(ds, "optimizer", (TYPE, OPTIMIZER_PARAMS, LEGACY_FUSION))
    scheduler = _section(ds, "scheduler", (TYPE, SCHEDULER_PARAMS))
    if optimizer is None:
        return                               # DeepSpeed builds none from the config (a client optimizer)
    name, params = config.optimizer_name, dict(optimizer.get(OPTIMIZER_PARAMS, {}))
    trial = _Trial(view_cls, config)
    sched = None if scheduler is None else (scheduler[TYPE], dict(scheduler.get(SCHEDULER_PARAMS, {})))
    if trial((name, params), sched) is None:
        return                               # the common case: one build, one step
    error = trial((name, params))
    if error is not None:
        _optimizer_error(trial, optimizer[TYPE], name, params, error)
    sname, sparams = sched
    error = trial((name, params), sched)
    cls = _scheduler_class(sname)
    if cls is None:
        raise ConfigError(_type_error("scheduler", sname, error))
    signature, var_kw = _signature(cls, skip=1)
    key = _blame(lambda p: trial((name, params), (sname, p)), sparams, signature)
    built_for = f"the scheduler DeepSpeed builds for scheduler.type {sname!r}"
    if key is None:
        missing = [k for k, p in signature.items() if p.default is p.empty and k not in sparams]
        fix = f"add scheduler.params.{missing[0]}" if missing else "fix the values named there"
        raise ConfigError(f"scheduler.params {json.dumps(sparams)}: {cls.__name__}, {built_for}, fails with them "
                          f"({_first_line(error)}); {fix}")
    raise ConfigError(_param_error("scheduler", sparams, key, error, cls, signature, var_kw, built_for))


def _optimizer_error(trial, type_name, name, params, error):
    if trial((name, {})) is not None:
        raise ConfigError(_type_error("optimizer", type_name, trial((name, {}))))
    cls = type(trial.built[0])
    signature, var_kw = _signature(cls, skip=1)
    key = _blame(lambda p: trial((name, p)), params, signature)
    built_for = f"what DeepSpeed builds for optimizer.type {type_name!r}"
    if key is None:
        raise ConfigError(f"optimizer.params {json.dumps(params)}: {cls.__name__}, {built_for}, fails with them "
                          f"({_first_line(error)}); fix the values named there")
    alone = trial((name, {key: params[key]}))
    raise ConfigError(_param_error("optimizer", params, key, alone or error, cls, signature, var_kw, built_for))
